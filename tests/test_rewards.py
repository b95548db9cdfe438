"""The length reward in TRL's signature (strings and chat messages)."""

import pytest

from colo_kit.rewards import completion_text, length_reward, make_length_reward


def test_length_reward_on_strings():
    assert length_reward(["a" * 20, "a" * 5, "a" * 31, ""]) == [0.0, -15.0, -11.0, -20.0]


def test_length_reward_on_chat_messages_and_target():
    chats = [[{"role": "assistant", "content": "x" * 12}], [{"role": "assistant", "content": "x" * 40}]]
    assert length_reward(chats, target=10) == [-2.0, -30.0]


def test_length_reward_ignores_dataset_columns_and_keeps_its_name():
    f = make_length_reward(3)
    assert f.__name__ == "length_reward"  # TRL logs rewards/<name>/mean
    assert f(prompts=["p"], completions=["abc"], completion_ids=[[1, 2]], answer=["x"]) == [0.0]


def test_bad_inputs_fail_clearly():
    with pytest.raises(ValueError, match="target=-1"):
        length_reward(["a"], target=-1)
    with pytest.raises(TypeError, match="type int"):
        completion_text(5)
