"""Offline prompt sets: shipped, regenerable byte for byte, loaded with the columns the kit needs."""

import json

import pytest

from colo_kit.data import load_math, load_tldr, math_prompt
from colo_kit.paths import data_dir
from conftest import load_script


def test_shipped_files_match_the_generators():
    make_data = load_script("scripts/make_data.py")
    for name, rows in (("tldr_prompts.jsonl", make_data.make_tldr_rows()), ("math_problems.jsonl", make_data.make_math_rows())):
        shipped = [json.loads(line) for line in (data_dir() / name).read_text().splitlines()]
        assert shipped == rows, f"data/{name} is stale: run `make data`"


def test_offline_loaders(caplog):
    tldr = load_tldr(source="offline")
    assert len(tldr) >= 300 and all(p.rstrip().endswith("TL;DR:") for p in tldr["prompt"][:50])
    math = load_math(source="offline")
    assert len(math) >= 200
    assert {"problem", "answer", "subject", "level", "unique_id"} <= set(math.column_names)
    assert len(set(math["subject"])) >= 5 and set(math["level"]) <= {1, 2, 3, 4, 5}
    assert "offline" in caplog.text  # the loader says which source it used


def test_auto_falls_back_offline_without_network(monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert len(load_tldr()) >= 300
    assert "standing in for trl-lib/tldr" in caplog.text


def test_bad_source_is_refused():
    with pytest.raises(ValueError, match="source='web'"):
        load_tldr(source="web")


def test_math_prompt_asks_for_a_boxed_answer():
    msg = math_prompt("What is 1+1?")
    assert msg[0]["role"] == "user" and "\\boxed{}" in msg[0]["content"]
