"""`colo-kit build-model [preset]`: `colo_kit.models.build_model` as a command; prints the folder it wrote."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from colo_kit.models import PRESETS, build_model
from colo_kit.paths import cache_dir
from colo_kit_cli.commands import UsageError, parse_dataclasses


@dataclass
class BuildArgs:
    """`colo-kit build-model [preset]`'s flags: `build_model`'s keyword arguments."""

    seed: int = field(default=0, metadata={"help": "random weights from this seed (one cached folder per seed)"})
    force: bool = field(default=False, metadata={"help": "rebuild even if cached"})


def main(argv: list[str]) -> int:
    # HfArgumentParser takes flags only: the preset, a leading word, is taken off first
    preset, argv = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else ("tiny", argv)
    buildable = sorted(n for n, p in PRESETS.items() if p.buildable)
    (args,) = parse_dataclasses((BuildArgs,), argv, prog="colo-kit build-model", description=(
        f"preset (a first word, before the flags): one of {', '.join(buildable)}; default tiny. {build_model.__doc__}"))
    if preset not in buildable:
        raise UsageError(f"preset {preset!r}: choose one of {', '.join(buildable)}")
    if not 0 <= args.seed <= 2**32 - 1:  # numpy's seed range: TRL's and transformers' set_seed seed numpy too
        raise UsageError(f"--seed {args.seed}: give a whole number from 0 to 2**32 - 1")
    try:
        cache = cache_dir()
    except OSError as exc:
        raise UsageError(f"cannot create the model cache ({exc.strerror}: {exc.filename}); set COLO_KIT_CACHE to a "
                         "writable folder") from None
    if not os.access(cache, os.W_OK):
        raise UsageError(f"the model cache {cache} is not writable; set COLO_KIT_CACHE to a writable folder")
    print(build_model(preset, **asdict(args)))
    return 0
