"""The library's host-RAM tier on a store on S3: `solve` TTFT with the entries' states in RAM vs
read from the store, on moto's S3 server (127.0.0.1, plain HTTP; the store's local disk cache
tier on), the same problems and examples alternating warm / cold. Needs kvmemory[s3] and moto.

    python benchmarks/bench_library_tier.py [--problems 20] [--seeded 30]
"""
import argparse, json, os, sys, time, random, socket, subprocess, statistics, tempfile, uuid
from datetime import datetime, timezone
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import boto3
from machine import describe
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--problems", type=int, default=20)
ap.add_argument("--seeded", type=int, default=30)
ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
args = ap.parse_args()
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(4)
ep = f"http://127.0.0.1:{port}"
os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
                  AWS_ALLOW_HTTP="true", AWS_ENDPOINT_URL=ep, KVMEMORY_STORE_CACHE_DIR=tempfile.mkdtemp())
b = f"kvm-{uuid.uuid4().hex[:8]}"
boto3.client("s3", endpoint_url=ep, aws_access_key_id="testing", aws_secret_access_key="testing",
             region_name="us-east-1").create_bucket(Bucket=b)
from problems import draw
import kvmemory
from kvmemory.library import answer_is
seed = random.SystemRandom().randrange(2**31)
rng = random.Random(seed)
evals = draw(rng, args.problems); seeds = draw(rng, args.seeded, avoid={p[1] for p in evals})
m = kvmemory.Memory(f"s3://{b}/lib")
for _, t, a, w in seeds:
    m.learn(t, w, verify=answer_is(a))
tier = m.library.states; budget = tier.budget_bytes
res = {"warm": [], "cold": []}
m.solve(evals[0][1], k=3, reuse=False, learn=False, max_new_tokens=1)
for _, t, a, w in evals:
    for mode in ("warm", "cold"):
        tier.set_budget(budget if mode == "warm" else 0)
        if mode == "warm":      # the entries this problem picks are in RAM (as in a hot library)
            m.solve(t, k=3, reuse=False, learn=False, max_new_tokens=1)
        sol = m.solve(t, k=3, reuse=False, learn=False, max_new_tokens=1)
        res[mode].append((sol.stats["timings_s"]["ttft"], sol.stats["states_from_ram"], sol.answer))
out = {"seed": seed, "machine": describe(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
       "args": vars(args), "same_answers": [a[2] for a in res["warm"]] == [a[2] for a in res["cold"]]}
for k, v in res.items():
    out[k] = {"ttft_median": statistics.median(x[0] for x in v), "states_from_ram": sum(x[1] for x in v)}
    print(f"{k}: median TTFT {out[k]['ttft_median']:.3f} s, states from RAM {out[k]['states_from_ram']}")
print(f"cold / warm {out['cold']['ttft_median'] / out['warm']['ttft_median']:.2f}x; same answers: {out['same_answers']}")
m.close(); proc.terminate()
path = Path(args.out) / f"library-tier-{datetime.now():%Y-%m-%d}.json"
path.write_text(json.dumps(out, indent=1))
print(f"wrote {path}; seed {seed}")
