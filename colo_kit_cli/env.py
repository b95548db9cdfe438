"""`colo-kit env`: the tier, hardware and versions (`colo_kit.env.describe`) as JSON."""

from __future__ import annotations

import json

from colo_kit.env import describe
from colo_kit_cli.commands import ArgumentParser


def main(argv: list[str]) -> int:
    ArgumentParser(prog="colo-kit env", description="The tier, hardware and versions as JSON.").parse_args(argv)
    print(json.dumps(describe(), indent=1))
    return 0
