"""Math500's answer checker, the judge behind the math reward (notebook 05): `is_correct(completion, gold)` is
math-verify plus what a MATH grader does around it, measured on `data/math500_checker_cases.jsonl`. math-verify's
timeout uses `signal.alarm` (main thread only; TRL calls rewards from any thread), so `Checker` runs each comparison in
a plain worker process (`pebble` cannot start inside a daemonic worker), killed and replaced when it overruns.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import asdict

from colo_kit.answers.answer_check import (DEFAULT_DEADLINE_S, MAX_ANSWER_CHARS, MAX_COMPLETION_CHARS,  # noqa: F401
                                           CheckerTimeout, UnparseableGold, Verdict, check, last_boxed, simple_number)


def _worker_main() -> None:
    """Loop of the checker worker: one JSON request per stdin line, one JSON verdict per stdout line."""
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but verdicts on the pipe
    check("\\boxed{1}", "1")  # warm the parser before saying ready
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            v = asdict(check(req["completion"], req["gold"]))
        except Exception as exc:  # a checker bug must not kill the worker: count it wrong, say why
            v = {"correct": False, "answer": None, "reason": f"error: {type(exc).__name__}: {exc}"[:200], "gold_ok": True}
        out.write(json.dumps(v) + "\n")
        out.flush()


class _Worker:
    """One checker process: JSON lines in on stdin, out on stdout."""

    def __init__(self):
        from colo_kit.procs import child_env

        env = child_env(OMP_NUM_THREADS="1")  # importable even when the kit is not pip-installed
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from colo_kit.answers.math500 import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.pid = os.getpid()  # the process that owns it (a forked child must not use it)
        self.ready = False
        self._buf = b""

    def readline(self, timeout_s: float) -> bytes | None:
        end = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # the worker died
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()  # not waited for (subprocess reaps it later): the caller returns now


class Checker:
    """`check` in worker processes with a deadline per comparison, thread- and fork-safe: an overrun is `timed_out`."""

    def __init__(self, deadline_s: float = DEFAULT_DEADLINE_S, max_workers: int = 8, start_timeout_s: float = 120.0):
        if not deadline_s > 0:
            raise ValueError(f"deadline_s={deadline_s!r}: give the seconds a comparison may take, e.g. 3.0")
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers!r}: at least one worker process is needed")
        self.deadline_s, self.max_workers, self.start_timeout_s = deadline_s, max_workers, start_timeout_s
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy = 0
        self.restarts = 0

    def _take(self) -> _Worker:
        with self._cond:
            self._idle = [w for w in self._idle if w.alive()]
            while not self._idle and self._busy >= self.max_workers:
                self._cond.wait()
                self._idle = [w for w in self._idle if w.alive()]
            self._busy += 1
            if self._idle:
                return self._idle.pop()
        try:
            return _Worker()
        except BaseException:
            self._give(None)
            raise

    def _give(self, worker: _Worker | None) -> None:
        with self._cond:
            self._busy -= 1
            if worker is not None:
                self._idle.append(worker)
            self._cond.notify()

    def check(self, completion: str, gold: str) -> Verdict:
        """`check(completion, gold)` in a worker; returns within `deadline_s` whatever the input."""
        if not isinstance(completion, str) or not isinstance(gold, str):
            raise TypeError(f"check(completion, gold) takes two strings, got {type(completion).__name__} "
                            f"and {type(gold).__name__}")
        completion = completion[-MAX_COMPLETION_CHARS:]  # what `check` reads anyway; keeps the pipe short
        worker = self._take()
        try:
            if not worker.ready:
                # a cold worker's imports are not the input's time: the deadline starts after them
                if worker.readline(self.start_timeout_s) is None:
                    dead = worker.proc.poll() is not None
                    worker.kill()
                    worker = None
                    if dead:
                        raise RuntimeError(f"the checker worker exited at start-up; run `{sys.executable} -c "
                                           "'import math_verify'` to see why")
                    return Verdict(False, None, f"timeout: checker worker not started after {self.start_timeout_s} s",
                                   timed_out=True)
                worker.ready = True
            end = time.monotonic() + self.deadline_s
            try:
                worker.proc.stdin.write((json.dumps({"completion": completion, "gold": gold}) + "\n").encode())
                worker.proc.stdin.flush()
                line = worker.readline(max(0.0, end - time.monotonic()))
            except OSError:  # the worker died (killed from outside, out of memory): same as a timeout
                line = None
            if line is None:
                worker.kill()
                worker = None
                self.restarts += 1
                threading.Thread(target=self._replace, daemon=True).start()
                return Verdict(False, None, f"timeout after {self.deadline_s} s", timed_out=True)
            return Verdict(**json.loads(line))
        finally:
            self._give(worker)

    def _replace(self) -> None:
        with self._cond:
            if len(self._idle) + self._busy >= self.max_workers:
                return
            self._busy += 1
        try:
            worker = _Worker()
        except Exception:
            worker = None
        self._give(worker)

    def warm_up(self, workers: int = 1) -> None:
        """Start `workers` processes and wait until ready, so a training run's first reward skips the start-up."""
        taken = [self._take() for _ in range(workers)]
        for w in taken:
            try:
                if not w.ready and w.readline(self.start_timeout_s) is not None:
                    w.ready = True
            finally:
                self._give(w)

    def close(self) -> None:
        with self._cond:
            for w in self._idle:
                w.kill()
            self._idle = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_default: Checker | None = None
_default_lock = threading.Lock()


def default_checker() -> Checker:
    global _default
    with _default_lock:
        if _default is None:
            _default = Checker()
        return _default


def is_correct(completion: str, gold: str) -> bool:
    """True if the completion's final answer equals the gold one, within the deadline (4 s) whatever the input. Raises
    `UnparseableGold` for unreadable gold, `CheckerTimeout` when out of time (it says nothing about the answer)."""
    verdict = default_checker().check(completion, gold)
    if verdict.timed_out:
        raise CheckerTimeout(f"the comparison took longer than {default_checker().deadline_s} s ({verdict.reason})")
    if not verdict.gold_ok:
        raise UnparseableGold(f"gold answer {gold!r} cannot be parsed (empty, over {MAX_ANSWER_CHARS} "
                              "characters, or not LaTeX math-verify reads); fix the dataset's `answer` column")
    return verdict.correct
