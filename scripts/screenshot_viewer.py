"""Screenshot the HTML sample viewer (``tito inspect DIR --html``) with headless Chromium.

    python scripts/screenshot_viewer.py [OUT_DIR] [--sample N] [--token K] [--png docs/viewer.png]

OUT_DIR is a ``tito run`` output (default ``out/demo``: ``make run`` writes it). Without ``--sample``
the row with the most turns is shown (the most messages, so the most colours). ``--token K`` pins the
hover box on token K (``#sN/tK`` in the page's address; default: the least likely sampled token). Needs Chromium (Debian: ``apt-get install -y
chromium``); not part of the test suite.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def pick_sample(out_dir: Path) -> int:
    """The row with the most turns among the first 200 (ties: the first)."""
    from rollout.data import open_shards

    t = open_shards(out_dir).head(200, columns=["turn_index"]).to_pylist()
    return max(range(len(t)), key=lambda i: (max(t[i]["turn_index"] or [0]), -i))


def lowest_logprob_token(out_dir: Path, sample: int) -> int:
    """The sampled token the sampler found least likely (the most interesting one to hover)."""
    from rollout.data import open_shards

    row = open_shards(out_dir).take([sample]).select(["loss_mask", "logprobs"]).to_pylist()[0]
    sampled = [i for i, m in enumerate(row["loss_mask"]) if m]
    return min(sampled, key=lambda i: row["logprobs"][i]) if sampled else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", default=str(REPO / "out" / "demo"))
    ap.add_argument("--sample", type=int, help="row to show (default: the one with the most turns)")
    ap.add_argument("--token", type=int, help="pin the hover box on this token (default: the least likely sampled one)")
    ap.add_argument("--heat", action="store_true", help="screenshot with the logprob heat on")
    ap.add_argument("--png", default=str(REPO / "docs" / "viewer.png"))
    ap.add_argument("--size", default="1400,900", help="window size W,H")
    args = ap.parse_args()

    from rollout.data import open_shards
    from rollout.data.viewer import write_viewer
    from rollout.models import resolve_model
    from tito_renderers import load_tokenizer

    out_dir = Path(args.out_dir)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        sys.exit("no Chromium found: apt-get install -y chromium")
    sample = pick_sample(out_dir) if args.sample is None else args.sample
    token = lowest_logprob_token(out_dir, sample) if args.token is None else args.token
    model = open_shards(out_dir).head(1, columns=["model"]).to_pylist()[0]["model"]
    tok = load_tokenizer(resolve_model(model))
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "viewer.html"
        # a few samples around the one shown, so the sample list has neighbours
        start = max(0, sample - 2)
        write_viewer(out_dir, page, start=start, limit=8, tokenizer=tok)
        anchor = f"#s{sample}/t{token}" + ("/heat" if args.heat else "")
        png = Path(args.png).resolve()
        png.parent.mkdir(parents=True, exist_ok=True)
        cmd = [chromium, *FLAGS, f"--user-data-dir={tmp}/profile", f"--screenshot={png}", f"--window-size={args.size}",
               "--virtual-time-budget=2000", page.as_uri() + anchor]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0 or not png.exists():
            sys.exit(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    print(f"{png}: sample {sample} of {out_dir}, {png.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
