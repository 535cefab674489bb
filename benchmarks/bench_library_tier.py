"""The library's host-RAM tier on a store on S3: `solve` TTFT with the entries' states in RAM vs
read from the store, on moto's S3 server (127.0.0.1, plain HTTP; the store's local disk cache
tier on), the same problems and examples alternating warm / cold. Needs kvmemory[s3] and moto.

    python benchmarks/bench_library_tier.py [--problems 20] [--seeded 30]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, write_json  # noqa: E402
from problems import draw  # noqa: E402
from s3server import start_moto  # noqa: E402


def measure(url: str, evals, seeds) -> dict:
    import kvmemory
    from kvmemory.library import answer_is

    res: dict = {"warm": [], "cold": []}
    with kvmemory.Memory(url) as m:
        for _, text, ans, worked in seeds:
            m.learn(text, worked, verify=answer_is(ans))
        tier = m.pager.host                     # where grafted examples' blocks are kept (kvmemory.graft)
        budget = tier.budget_bytes
        m.solve(evals[0][1], k=3, reuse=False, learn=False, max_new_tokens=1)       # warm the model
        for _, text, _, _ in evals:
            for mode in ("warm", "cold"):
                tier.set_budget(budget if mode == "warm" else 0)
                if mode == "warm":      # the entries this problem picks are in RAM, as in a hot library
                    m.solve(text, k=3, reuse=False, learn=False, max_new_tokens=1)
                sol = m.solve(text, k=3, reuse=False, learn=False, max_new_tokens=1)
                res[mode].append((sol.stats["timings_s"]["ttft"], sol.stats["blocks_from"]["host"], sol.answer))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=20, help="new problems solved warm and cold")
    ap.add_argument("--seeded", type=int, default=30, help="worked solutions in the library")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    evals = draw(rng, args.problems)
    seeds = draw(rng, args.seeded, avoid={p[1] for p in evals})
    proc, endpoint = start_moto()
    try:
        import boto3
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
                          AWS_ALLOW_HTTP="true", AWS_ENDPOINT_URL=endpoint,
                          KVMEMORY_STORE_CACHE_DIR=tempfile.mkdtemp(prefix="kvm-tier-"))
        bucket = f"kvm-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        res = measure(f"s3://{bucket}/lib", evals, seeds)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    out = {"seed": seed, "machine": describe(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "args": vars(args), "same_answers": [a[2] for a in res["warm"]] == [a[2] for a in res["cold"]]}
    for k, v in res.items():
        out[k] = {"ttft_median": statistics.median(x[0] for x in v), "blocks_from_ram": sum(x[1] for x in v)}
        print(f"{k}: median TTFT {out[k]['ttft_median']:.3f} s, blocks from RAM {out[k]['blocks_from_ram']}")
    print(f"cold / warm {out['cold']['ttft_median'] / out['warm']['ttft_median']:.2f}x; "
          f"same answers: {out['same_answers']}")
    path = Path(args.out) / f"library-tier-{datetime.now():%Y-%m-%d}.json"
    write_json(path, out, seed)
    print(f"wrote {path}; seed {seed}")


if __name__ == "__main__":
    main()
