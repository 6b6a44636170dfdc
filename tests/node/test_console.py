"""The web console in a real headless Chromium against a real node process: each page shows what
the node holds, cancel and redrive work from the page. Screenshots go to test-artifacts/console/."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest

from delayserver.sender.parked import parked_offsets
from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.buckets import bucket_name
from delayserver.storage.store import bucket_stats
from tests.node.live import start_http_node
from tests.procs import wait_for

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
TOKEN = "console-token"
WAIT_S = 60  # a real browser on a busy machine


@pytest.fixture
def browser(tmp_path):
    chromium = shutil.which("chromium")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("chromium and chromedriver are not installed (ops/test installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def console_node(tmp_path, webhook_server):
    """A node whose `hook.*` subjects go to a webhook answering 400 (so they are parked)."""
    webhook_server.respond(400, {"error": "no such queue"})
    config = tmp_path / "node.toml"
    config.write_text(f'''segment_scale = "10m"

[[broker_group]]
name = "spool"
transport = "spool"
subjects = ["orders.expire", "orders.now"]

[[broker_group]]
name = "hook"
transport = "http"
address = "{webhook_server.url}"
subjects = ["hook.x"]
''')
    node, base = start_http_node(tmp_path / "data", secret=TOKEN, extra_args=("--config", str(config)))
    try:
        yield node, base, webhook_server
    finally:
        node.kill()


def held_by(data_dir: Path, scale_ms: int = 600_000) -> dict[str, tuple[int, int, int, int, int]]:
    """Per bucket name: (scheduled, dispatched, cancelled, parked, pending), read from the segments
    and parked.log."""
    schedule_log = BucketLog.open(data_dir / "schedule_log", readonly=True)
    dispatch_log = BucketLog.open(data_dir / "dispatch_log", readonly=True)
    try:
        out = {}
        for bucket in schedule_log.buckets():
            s = bucket_stats(schedule_log, dispatch_log, bucket)
            parked = len(parked_offsets(data_dir / "parked", bucket, scale_ms))
            out[bucket_name(bucket)] = (s.scheduled, s.dispatched, s.cancelled, parked, s.pending - parked)
        return out
    finally:
        schedule_log.close()
        dispatch_log.close()


def open_page(driver, base: str, page: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base}/#{page}")
    WebDriverWait(driver, WAIT_S).until(lambda d: d.find_element("tag name", "body").get_attribute("data-loaded") == page)


def wait_text(driver, element_id: str, predicate) -> str:
    from selenium.webdriver.support.ui import WebDriverWait

    from selenium.common.exceptions import StaleElementReferenceException

    WebDriverWait(driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: predicate(d.find_element("id", element_id).text))
    return driver.find_element("id", element_id).text


def table_rows(driver, table_id: str) -> list[list[str]]:
    """The cells' texts of each row. The console redraws its tables as it refreshes itself: a
    redraw between finding the rows and reading them leaves their elements stale, and the table
    is read again (as it is drawn then)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    def read(d):  # in a 1-tuple: an empty table is an answer too
        rows = d.find_elements("css selector", f"#{table_id} tbody tr")
        return ([[td.text for td in row.find_elements("tag name", "td")] for row in rows],)

    return WebDriverWait(driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(read)[0]


def shot(driver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def test_each_console_page_shows_what_the_node_holds_and_cancel_and_redrive_work(console_node, browser):
    node, base, webhook = console_node
    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    pending = [api.post("/v1/messages", json={"subject": "orders.expire", "body": f"order {i}",
                                              "delay_ms": delay}).json()["handle"]
               for i, delay in enumerate((120_000, 900_000, 1_500_000, 2_400_000))]
    for i in range(2):
        api.post("/v1/messages", json={"subject": "orders.now", "body": f"now {i}"})
    parked = api.post("/v1/messages", json={"subject": "hook.x", "body": "to a broken hook", "id": "hook-1"}).json()
    assert wait_for(lambda: api.get("/v1/overview").json()["delivery"] == {
        **api.get("/v1/overview").json()["delivery"], "delivered": 2, "parked": 1}, timeout=30)
    data_dir = node.data_dir
    assert wait_for(lambda: sum(b[4] for b in held_by(data_dir).values()) == 4, timeout=30)

    # The token form comes first; the overview loads once the token is given.
    from selenium.webdriver.support.ui import WebDriverWait
    browser.get(f"{base}/#overview")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element("id", "login").is_displayed())
    shot(browser, "0-token")
    browser.find_element("id", "token").send_keys(TOKEN)
    browser.find_element("css selector", "#login button").click()
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element("tag name", "body").get_attribute("data-loaded") == "overview")

    # Overview: the counts the node holds, the broker groups, the lateness of the two deliveries.
    assert wait_text(browser, "ov-pending", lambda t: t == "4") == "4"
    assert browser.find_element("id", "ov-due-minute").text == "0"
    assert browser.find_element("id", "ov-due-hour").text == "4"
    assert browser.find_element("id", "ov-delivered").text == "2"
    groups = {row[0]: row for row in table_rows(browser, "ov-groups")}
    assert set(groups) == {"spool", "hook"}
    assert groups["spool"][2] == "closed" and groups["spool"][4] == "2" and groups["hook"][6] == "1"
    bars = browser.find_elements("css selector", "#ov-lateness rect")
    assert sum(int(b.get_attribute("data-count")) for b in bars) == 2
    assert "master" in browser.find_element("id", "node-badge").text
    shot(browser, "1-overview")

    # Backlog: one row per bucket, equal to the segments' counts, and a line per pending bucket.
    open_page(browser, base, "backlog")
    held = held_by(data_dir)
    rows = table_rows(browser, "bl-table")
    assert {r[0]: tuple(int(x) for x in r[1:]) for r in rows} == held
    lines = {p.get_attribute("data-bucket") for p in browser.find_elements("css selector", "#bl-chart polyline")}
    # A line per bucket pending now, and per bucket pending in an earlier sample (the due ones
    # were pending for a moment before their delivery).
    assert {name for name, counts in held.items() if counts[4]} <= lines <= set(held)
    shot(browser, "2-backlog")

    # Messages: look a pending message up, press cancel, see it cancelled; the node agrees.
    open_page(browser, base, "messages")
    browser.find_element("id", "search-handle").send_keys(pending[0])
    browser.find_element("css selector", "#search button").click()
    assert wait_text(browser, "msg-state", lambda t: t == "pending") == "pending"
    shot(browser, "3-message-pending")
    browser.find_element("id", "msg-cancel").click()
    assert wait_text(browser, "msg-state", lambda t: t == "cancelled") == "cancelled"
    assert "cancelled" in browser.find_element("id", "msg-outcome").text
    assert api.get(f"/v1/messages/{pending[0]}").json()["state"] == "cancelled"
    assert wait_for(lambda: sum(b[2] for b in held_by(data_dir).values()) == 1, timeout=30)
    shot(browser, "4-message-cancelled")

    # Parked: the message the hook refused, then redriven once the hook takes it.
    open_page(browser, base, "parked")
    [row] = table_rows(browser, "pk-table")
    assert row[1] == "hook.x" and row[2] == parked["handle"] and "hook" in row[4]
    shot(browser, "5-parked")
    webhook.respond(200)
    browser.find_element("id", "redrive").click()
    assert "redrove 1" in wait_text(browser, "redrive-result", lambda t: "redrove" in t)
    assert wait_for(lambda: api.get("/v1/overview").json()["delivery"]["delivered"] == 3, timeout=30)
    assert webhook.batches[-1]["messages"][0]["id"] == "hook-1"

    # Cluster: this node, its role, and the group's nodes.
    open_page(browser, base, "cluster")
    node_info = api.get("/v1/node").json()
    text = browser.find_element("id", "cl-node").text
    assert node_info["node_id"] in text and "master" in text
    assert [r[2] for r in table_rows(browser, "cl-nodes")] == ["master"]
    shot(browser, "6-cluster")

    # The console refreshes itself: a message sent now shows up without a reload.
    open_page(browser, base, "overview")
    api.post("/v1/messages", json={"subject": "orders.expire", "delay_ms": 30_000})
    deadline = time.monotonic() + WAIT_S
    while browser.find_element("id", "ov-pending").text != "4" and time.monotonic() < deadline:
        time.sleep(0.2)  # pending: 4 - 1 cancelled + 1 new
    assert wait_text(browser, "ov-due-minute", lambda t: t == "1") == "1"
    assert browser.find_element("id", "ov-pending").text == "4"
    # The one 401 is the first load, before the token was given.
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "status of 401" not in e["message"]]
    assert errors == [], errors


def test_the_console_loads_nothing_from_outside_the_node():
    import re
    from importlib import resources

    static = resources.files("delayserver.node.http") / "static"
    names = sorted(p.name for p in static.iterdir())
    assert names == ["console.css", "console.js", "index.html"]
    for name in names:
        text = (static / name).read_text()
        # The only absolute URL is the SVG namespace, which browsers never fetch.
        urls = set(re.findall(r"(?:https?:)?//[A-Za-z0-9.-]+\.[a-z]{2,}[^\s\"')]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)
