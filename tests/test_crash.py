"""Crash trials in the suite: `kvmemory add` / `kvmemory save` SIGKILLed at random moments (half of
them inside a commit), the store checked after every kill. The full run (>= 200 trials) is
benchmarks/bench_crash.py; this is the same program, bounded."""

from benchmarks.bench_crash import run_trials
from tests.bounds import bound
from tests.conftest import SEED


def test_sigkill_at_random_moments_loses_nothing(tmp_path, tiny_dir):
    trials = bound("KVMEMORY_CRASH_TRIALS", 6, 16)
    res = run_trials(trials, SEED, tmp_path / "work", model=tiny_dir, progress=False)
    assert res["trials"] == trials
    assert res["killed"] >= trials // 2, res                  # most trials were really interrupted
    assert res["killed_inside_commit"] >= 1, res
    for k in ("unreadable_stores", "verify_failures", "lost_documents", "lost_states", "ask_failures",
              "resume_failures", "final_verify_failures"):
        assert res[k] == 0, (k, res["failures"])
    assert res["resumed"] == trials
