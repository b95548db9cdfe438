"""The lab record: the runs behind every number the lessons show, kept apart from the kit.

`results/` holds what the runs wrote (JSON with hardware, versions, settings and raw times); this package holds the
code that writes, merges, judges and reports on them. It imports `colo_kit`; `colo_kit` never imports it. The
lessons read a committed result through `colo_kit.results`, never through this package.

    store       atomic writes of committed files, refused for a failed or empty run
    speed, race the speed race (scripts/gpu/speed.sh) and its judgment
    planner_validation   the memory planner against measured peaks
    router_compare       the kit's proxy beside vllm-router
    refresh     the notebooks' headers, README's and INSTRUCTOR.md's tables from the check runs
    status      the freshness report (`make numbers-status`)
"""
