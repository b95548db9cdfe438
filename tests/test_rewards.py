"""The length reward in TRL's signature (strings and chat messages)."""

import pytest

from colo_kit.grpo.rewards import completion_text, length_reward, make_length_reward


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


@pytest.mark.parametrize("completions, words", [("a string", "not str"), (None, "not NoneType"),
                                                (b"bytes", "not bytes"), (5, "not int")])
def test_completions_that_are_not_a_list_are_refused_not_read_letter_by_letter(completions, words):
    with pytest.raises(TypeError, match=words):
        length_reward(completions)


def test_a_bytes_completion_is_refused():
    with pytest.raises(TypeError, match="type bytes"):
        length_reward([b"twenty bytes of text"])


def test_math500_reward_gives_none_without_a_usable_gold_answer():
    from colo_kit.grpo.rewards import math500_reward

    assert math500_reward([r"\boxed{2}", r"\boxed{2}", r"\boxed{3}"], answer=["2", None, "2"]) == [1.0, None, 0.0]
    with pytest.raises(TypeError, match="not str"):
        math500_reward(r"\boxed{2}", answer="2")


@pytest.mark.parametrize("gold", [float("nan"), [float("nan")], float("inf"), b"2", [b"2"], {"2": 1}, [{"value": "2"}],
                                  True])
def test_math500_reward_gives_none_for_a_gold_answer_that_is_no_answer(gold):
    """NaN (pandas' empty cell), bytes or a dict is an unusable label: None, which TRL ignores, never a 0.0 that
    punishes the policy nor a 1.0 matched against some piece of it."""
    from colo_kit.grpo.rewards import math500_reward

    assert math500_reward([r"\boxed{2}"], answer=gold) == [None]


@pytest.mark.parametrize("gold", [2, [2], 2.0, ["2", 2]])
def test_math500_reward_checks_a_number_as_its_string_form(gold):
    from colo_kit.grpo.rewards import math500_reward

    n = len(gold) if isinstance(gold, list) else 1
    assert math500_reward([r"\boxed{2}"] * n, answer=gold) == [1.0] * n
    assert math500_reward([r"\boxed{3}"] * n, answer=gold) == [0.0] * n


def test_a_target_past_any_length_is_one_line():
    with pytest.raises(ValueError, match="target above 1000000000") as info:
        length_reward(["a"], target=10**400)
    assert len(str(info.value)) < 200  # the 401 digits are not printed


@pytest.mark.parametrize("gold", [1e20, [1e20], 10**20])
def test_math500_reward_reads_a_float_gold_as_the_number_it_is(gold):
    """A dataset's float 1e20 is 10**20: its string '1e+20' would read as e times 20 and fail a right answer."""
    from colo_kit.grpo.rewards import math500_reward

    right = [r"\boxed{1e20}", r"\boxed{100000000000000000000}", "so the answer is $\\boxed{1E+20}$"]
    assert math500_reward(right, answer=gold if not isinstance(gold, list) else gold * 3) == [1.0, 1.0, 1.0]
    assert math500_reward([r"\boxed{1e21}", r"\boxed{2e20}"], answer=1e20) == [0.0, 0.0]
    assert math500_reward([r"\boxed{0.00000000000000000001}", r"\boxed{1e-20}"], answer=1e-20) == [1.0, 1.0]
