"""The README's screenshot of the page in use: a live `kvmemory serve` app with the real default
model on a temporary store, a document deposited through the page (file input), a question
asked, a chat turn with a user's memory, in headless Chromium. Writes docs/page.png.

    python docs/make_screenshot.py [--out docs/page.png]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOC = """Harbor maintenance manual, section 4: mooring.

The north pier takes vessels up to 40 metres. Every bollard on the north pier is load-tested each
March; the last test passed at 30 tonnes. Mooring lines are replaced after 18 months of service or
at the first sign of chafing, whichever comes first.

The harbor master's office is open from 07:00 to 19:00. After hours, call the duty officer on
channel 14. The fuel dock closes at 18:00 and sells diesel only.

Section 5: cranes. The mobile crane lifts at most 12 tonnes at a radius of 10 metres. Lifts above
8 tonnes need a signed lift plan and a second banksman.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "page.png"))
    args = ap.parse_args()
    import kvmemory
    from kvmemory.server import create_app
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.keys import Keys
    from tests.test_server import _start

    work = Path(tempfile.mkdtemp(prefix="kvm-shot-"))
    mem = kvmemory.Memory(work / "s.kvm")
    srv, t, url = _start(create_app(mem))
    (work / "harbor-manual.txt").write_text(DOC)
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1250"):
        opts.add_argument(a)
    d = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
    css = lambda s: d.find_element("css selector", s)          # noqa: E731

    def wait(cond, what, timeout=600):
        end = time.time() + timeout
        while time.time() < end:
            try:
                if cond():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise SystemExit(f"timed out waiting for {what}")
    try:
        d.get(url + "/")
        css("#file-input").send_keys(str(work / "harbor-manual.txt"))
        wait(lambda: css("#jobs .job-status").text.startswith("done"), "the deposit")
        css("#question").send_keys("How much does the mobile crane lift?", Keys.ENTER)
        wait(lambda: "restored" in css("#ask-figures").text, "the answer")
        css("#chat-user").send_keys("alice")
        css("#chat-message").send_keys("Hi! I keep my boat at the north pier.", Keys.ENTER)
        wait(lambda: css("#turns li.assistant .meta").text, "the chat reply")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        d.save_screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        d.quit()
        srv.should_exit = True
        t.join(timeout=10)
        mem.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
