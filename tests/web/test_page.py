"""The page at / in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium) against a live `kvmemory serve` app on 127.0.0.1 with the tiny random-weight model:
upload a file and watch its deposit to done, ask and see the streamed answer (the very text the
API answers) with its passage, chat, delete a document, and read the errors a person meets (a
wrong key, a file too large)."""

import os
import shutil
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
webdriver = pytest.importorskip("selenium.webdriver")

import kvmemory  # noqa: E402
from tests.server.test_server import _start  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER) and os.environ.get("KVMEMORY_REQUIRE_BROWSER") == "1":
    raise RuntimeError("KVMEMORY_REQUIRE_BROWSER=1 but chromium or chromedriver is missing")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs chromium and chromedriver "
                                "(.ci/run installs Debian's chromium and chromium-driver)")
KEY = "s3cret-key"


@pytest.fixture
def server(tmp_path, tiny, request):
    from kvmemory.server import create_app
    mem = kvmemory.Memory(tmp_path / "s.kvm", model=tiny, segment_blocks=1)
    app = create_app(mem, queue_size=4, max_body_bytes=64 << 10, api_key=getattr(request, "param", None))
    srv, t, url = _start(app)
    yield url, mem
    srv.should_exit = True
    t.join(timeout=10)
    mem.close()


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1400"):
        opts.add_argument(a)
    d = webdriver.Chrome(options=opts, service=Service(DRIVER))
    d.set_script_timeout(60)
    yield d
    d.quit()


def until(cond, timeout=90, what="the page"):
    end = time.time() + timeout
    while time.time() < end:
        try:
            v = cond()
        except Exception:          # an element not there yet, a stale one
            v = None
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def human(n: float) -> str:
    """The page's byte figures (app.js bytes())."""
    units, i = ["B", "KB", "MB", "GB", "TB"], 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.{1 if n < 10 and i else 0}f} {units[i]}"


def css(d, sel):
    return d.find_element("css selector", sel)


def test_upload_watch_ask_chat_delete(server, browser, tmp_path):
    url, mem = server
    d = browser
    d.get(url + "/")
    until(lambda: css(d, "#model").text.startswith("Model:"), what="the model name")
    assert css(d, "#no-docs").is_displayed()
    words = ("river lantern copper meadow falcon harbor quartz willow ember glacier " * 60).split()
    f = tmp_path / "notes.txt"
    f.write_text(" ".join(words[:500]) + " The vault code is 4417. " + " ".join(words[:400]))
    css(d, "#file-input").send_keys(str(f))
    status = until(lambda: (s := css(d, "#jobs .job-status").text).startswith("done") and s, what="the deposit")
    n_tokens = mem.require_store().manifest.docs["notes.txt"].n_tokens
    assert status == f"done: {n_tokens:,} tokens"
    row = until(lambda: css(d, '#doc-list tr[data-doc-id="notes.txt"]'), what="the document row")
    cells = [c.text for c in row.find_elements("css selector", "td")]
    from kvmemory.store.info import per_token_bytes
    kv = n_tokens * per_token_bytes(mem.require_store().manifest)
    assert httpx.get(url + "/v1/documents").json()["data"][0]["kv_bytes"] == kv
    assert cells[0] == "notes.txt" and cells[1] == f"{n_tokens:,}" and cells[3] == human(kv)
    assert not css(d, "#no-docs").is_displayed()

    # ask: Enter submits; the streamed answer is exactly the API's, its passage is shown
    q = css(d, "#question")
    q.send_keys("What is the vault code?")
    from selenium.webdriver.common.keys import Keys
    q.send_keys(Keys.ENTER)
    figures = until(lambda: (t := css(d, "#ask-figures").text).endswith("tokens") and t, what="the answer")
    api = httpx.post(url + "/v1/ask", json={"question": "What is the vault code?"}, timeout=120).json()
    text = lambda sel: d.execute_script(f"return document.querySelector('{sel}').textContent")  # noqa: E731
    assert text("#answer") == api["answer"]
    st = api["stats"]
    assert f"{st['tokens_restored']:,} tokens restored, {st['tokens_prefilled']:,} prefilled" in figures
    assert f"would have prefilled {st['tokens_restored'] + st['tokens_prefilled']:,} tokens" in figures
    passages = d.find_elements("css selector", "#passages li")
    assert len(passages) == len(api["sources"]) >= 1
    assert passages[0].find_element("css selector", ".source").text.startswith("notes.txt, tokens ")
    assert text("#passages li .passage") == api["sources"][0]["text"]

    # chat: a turn and its figures
    css(d, "#chat-message").send_keys("Hello there", Keys.ENTER)
    meta = until(lambda: css(d, "#turns li.assistant .meta").text, what="the chat reply")
    assert "prompt tokens restored" in meta
    assert [li.get_attribute("class") for li in d.find_elements("css selector", "#turns li")] == ["user", "assistant"]

    # a file over the server's body limit: a readable 413, nothing added
    big = tmp_path / "big.txt"
    big.write_text("word " * 20000)
    css(d, "#file-input").send_keys(str(big))
    err = until(lambda: css(d, "#error").is_displayed() and css(d, "#error").text, what="the 413 message")
    assert err.startswith("Too large for this server")
    assert sorted(mem.require_store().manifest.docs) == ["notes.txt"]

    # delete: confirm, the row goes, the store no longer lists it
    css(d, '#doc-list tr[data-doc-id="notes.txt"] button.delete').click()
    d.switch_to.alert.accept()
    until(lambda: not d.find_elements("css selector", '#doc-list tr[data-doc-id="notes.txt"]'), what="the delete")
    assert httpx.get(url + "/v1/documents").json()["data"] == []
    d.save_screenshot(str(tmp_path / "page.png"))


@pytest.mark.parametrize("server", [KEY], indirect=True)
def test_a_wrong_key_is_a_readable_error_and_the_right_one_opens_the_page(server, browser):
    url, _ = server
    d = browser
    d.get(url + "/")
    d.execute_script("sessionStorage.clear()")
    d.get(url + "/")
    until(lambda: css(d, "#key-dialog").get_attribute("open") is not None, what="the key dialog")
    assert css(d, "#error").text.startswith("The server needs a valid API key.")
    css(d, "#key-input").send_keys("wrong")
    css(d, "#key-save").click()
    until(lambda: css(d, "#key-dialog").get_attribute("open") is not None and css(d, "#error").is_displayed(),
          what="the 401 again")
    assert "API key" in css(d, "#error").text and css(d, "#model").text == ""
    css(d, "#key-input").clear()
    css(d, "#key-input").send_keys(KEY)
    css(d, "#key-save").click()
    until(lambda: css(d, "#model").text.startswith("Model:"), what="the page with the right key")
    assert not css(d, "#error").is_displayed()
    assert d.execute_script("return sessionStorage.getItem('kvmemory-api-key')") == KEY
    r = httpx.get(url + "/")                     # the page itself needs no key; the API does
    assert r.status_code == 200 and "<title>kvmemory</title>" in r.text
    assert httpx.get(url + "/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(url + "/v1/documents").status_code == 401
    assert httpx.get(url + "/ui/secret.txt").status_code == 401        # only the page's own files are open
    assert httpx.get(url + "/ui/secret.txt", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
