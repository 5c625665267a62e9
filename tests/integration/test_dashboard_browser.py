"""The dashboard in a real browser (headless Chromium through Selenium),
against a real node process with a real worker process.

One walk through the page, in the order a user would go: a run appears live
after an emit, its steps and output show, a re-run from its page starts a new
run of the same event that completes, a waiting run shows why and a
countdown and is cancelled from the page, a run whose worker was killed with
SIGKILL shows its two segments, a function invoked from its form with JSON
data runs with that data, the capacity view works with a platform key, and an
XSS payload in a step output stays text. With ``IRONFLOW_SCREENSHOTS=1`` the
walk also rewrites the screenshots of the main pages in ``docs/screenshots/``
(the README's pictures); otherwise it leaves them alone.

A second walk drives run control from a run's page (docs/run-control.md):
resume a failed run from its failed step, pause a sleeping run, find it in
the runs list as paused, and resume it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.integration.helpers import wait_for_step
from tests.integration.procs import ROOT, Proc, start_node

pytestmark = pytest.mark.slow

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import NoAlertPresentException, TimeoutException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

DASHBOARD_WORKER = ROOT / "tests" / "procs" / "dashboard_worker.py"
RESUME_WORKER = ROOT / "tests" / "procs" / "resume_worker.py"
SCREENSHOTS = ROOT / "docs" / "screenshots"
# Screenshots are rewritten only when asked, so a test run leaves the tree clean.
TAKE_SCREENSHOTS = os.environ.get("IRONFLOW_SCREENSHOTS") == "1"
# Long enough for a 2 s poll plus a slow shared machine.
WAIT_S = 20.0
# The paused run's sleep: long enough for the click to land inside it on a loaded machine.
NAP_S = 4.0
# Sets a global if the payload ever runs as markup: the test checks it never does.
XSS = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'


def _find(names: list[str]) -> str | None:
    for name in names:
        found = shutil.which(name) or (name if Path(name).exists() else None)
        if found:
            return found
    return None


CHROMIUM = _find(["chromium", "chromium-browser", "/usr/bin/chromium"])
CHROMEDRIVER = _find(["chromedriver", "/usr/bin/chromedriver"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--lang=en-US"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


async def _start_worker(server: str, state: Path, log_dir: Path, name: str) -> Proc:
    proc = Proc([sys.executable, str(DASHBOARD_WORKER), server], log_dir / f"{name}.log",
                env={"DASH_WORKER_STATE": str(state)})
    await proc.wait_line("READY")
    return proc


def _wait(driver: Any, what: str, predicate: Callable[[Any], Any]) -> Any:
    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.2).until(predicate)
    except TimeoutException as exc:
        raise AssertionError(f"the page never showed {what}; it shows: {_text(driver, 'main')[:2000]}") from exc


# The page redraws its live parts every 2 s, so elements are read in one
# script call (never found first and read later, when they may be gone).
def _text(driver: Any, css: str) -> str:
    return str(driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText.trim() : '';", css))


def _texts(driver: Any, css: str) -> list[str]:
    return list(driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((e) => e.innerText.trim());", css))


def _attrs(driver: Any, css: str, name: str) -> list[str]:
    return list(driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((e) => e.getAttribute(arguments[1]));",
        css, name))


def _count(driver: Any, css: str) -> int:
    return int(driver.execute_script("return document.querySelectorAll(arguments[0]).length;", css))


def _click(driver: Any, css: str) -> None:
    driver.execute_script("document.querySelector(arguments[0]).click();", css)


def _shot(driver: Any, name: str) -> None:
    if not TAKE_SCREENSHOTS:
        return
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script(
        "return Math.max(document.documentElement.scrollHeight, document.body.scrollHeight)")
    # The window's outer size includes the browser's own frame: leave room for it.
    driver.set_window_size(1400, max(700, min(int(height) + 140, 2000)))
    driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))
    driver.set_window_size(1400, 1000)


def _no_script_ran(driver: Any) -> None:
    assert driver.execute_script("return window.__xss === undefined"), "the payload ran as markup"
    try:
        alert = driver.switch_to.alert
    except NoAlertPresentException:
        return
    raise AssertionError(f"an alert opened: {alert.text}")


async def _run_status(http: httpx.AsyncClient, run_id: str, wanted: str) -> None:
    with trio.fail_after(WAIT_S):
        while (await http.get(f"/v1/runs/{run_id}")).json()["run"]["status"] != wanted:
            await trio.sleep(0.1)


async def test_dashboard_shows_live_runs_steps_waits_recoveries_and_capacity_and_renders_payloads_as_text(
    browser: Any, tmp_path: Path
) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    db = tmp_path / "ironflow.db"
    procs: list[Proc] = []
    try:
        procs.append(await start_node(str(db), tmp_path / "state", tmp_path, node_id="node_dash", port=port))
        worker = await _start_worker(base, tmp_path, tmp_path, "worker1")
        procs.append(worker)
        async with httpx.AsyncClient(base_url=base, timeout=10.0) as http:
            # 1. The runs page is open; a run emitted elsewhere appears without a reload.
            browser.get(base + "/#/runs")
            _wait(browser, "the empty runs table", lambda d: "No runs yet." in _text(d, "#runs-table"))
            emitted = (await http.post("/v1/events", json={"name": "dash.echo", "data": {"html": XSS}})).json()
            echo_run = emitted["run_ids"][0]
            row = f'tr[data-run-id="{echo_run}"]'
            _wait(browser, "the emitted run", lambda d: _count(d, row) == 1)
            _wait(browser, "the run completed", lambda d: "completed" in _text(d, row))
            assert "echo" in _text(browser, row) and "1/3" in _text(browser, row)

            # 2. Its page: both steps, their outputs, the run's output; the payload is text.
            _click(browser, f"{row} a")
            _wait(browser, "the run's output", lambda d: _count(d, "#run-output") == 1)
            assert _attrs(browser, "#steps .step", "data-step") == ["render", "count"]
            outputs = _texts(browser, "#steps .step-output")
            assert XSS.replace('"', '\\"') in outputs[0], outputs
            assert outputs[1] == "1"
            assert json.loads(_text(browser, "#run-output")) == {"rendered": {"html": XSS}, "count": 1}
            assert _count(browser, "main img, main script") == 0
            assert _count(browser, "#timeline .tl-bar") == 2
            _no_script_ran(browser)
            _shot(browser, "run")

            # 2b. Re-run it from its page: a new run of the same event, shown and completed.
            _click(browser, "#rerun-run")
            _wait(browser, "the re-run's page", lambda d: echo_run not in _text(d, "h1") and "run_" in _text(d, "h1"))
            rerun = _text(browser, "h1 .mono")
            _wait(browser, "the re-run completed", lambda d: _text(d, "#run-status") == "completed")
            again = (await http.get(f"/v1/runs/{rerun}")).json()["run"]
            assert again["event_id"] == emitted["event_id"] and again["function_id"] == "echo"
            assert again["output"] == {"rendered": {"html": XSS}, "count": 1}
            _no_script_ran(browser)

            # 3. The events page sends an event; the waiting run says why and counts down.
            browser.get(base + "/#/events")
            browser.find_element(By.ID, "event-name").send_keys("dash.nap")
            browser.find_element(By.ID, "event-data").send_keys('{"why": "a nap"}')
            browser.find_element(By.ID, "send-event").click()
            _wait(browser, "the started run", lambda d: _count(d, "#send-result a") == 1)
            nap_run = _text(browser, "#send-result a")
            _wait(browser, "the event in the list", lambda d: nap_run in _text(d, "#events-table"))
            _shot(browser, "events")
            _click(browser, "#send-result a")
            _wait(browser, "why the run waits", lambda d: "sleeping until" in _text(d, "#waiting-reason"))
            countdown = _text(browser, "#waiting .countdown")
            assert countdown.startswith("in 59 m") or countdown.startswith("in 1 h"), countdown
            _shot(browser, "run-waiting")

            # 4. Cancel it from the page.
            _click(browser, "#cancel-run")
            _wait(browser, "the run cancelled", lambda d: _text(d, "#run-status") == "cancelled")
            await _run_status(http, nap_run, "cancelled")

            # 5. A worker killed with SIGKILL mid-step: the run's second segment says it was recovered.
            crash_run = (await http.post("/v1/events", json={"name": "dash.crash"})).json()["run_ids"][0]
            await worker.wait_line(f"HANGING {crash_run}")
            await wait_for_step(http, crash_run, "one")  # its result reached the engine
            worker.signal(signal.SIGKILL)
            procs.append(await _start_worker(base, tmp_path, tmp_path, "worker2"))
            await _run_status(http, crash_run, "completed")
            browser.get(f"{base}/#/runs/{crash_run}")
            _wait(browser, "two segments", lambda d: _count(d, "#timeline .tl-seg") == 2)
            assert _attrs(browser, "#timeline .tl-seg", "data-seq") == ["1", "2"]
            second = _texts(browser, "#timeline .tl-seg")[1]
            assert "recovered" in second, second
            _shot(browser, "run-recovered")

            browser.get(base + "/#/runs")
            _wait(browser, "four runs", lambda d: _count(d, "tr.run-row") == 4)
            _wait(browser, "the runs-per-minute chart", lambda d: "4 runs" in _text(d, "#runs-chart"))
            assert _count(browser, "#runs-chart .chart .col") >= 60  # one column per minute of the hour
            _shot(browser, "runs")
            browser.get(base + "/#/functions")
            _wait(browser, "the functions", lambda d: "napper" in _text(d, "#functions-table"))
            _wait(browser, "the hour's counts", lambda d: _text(d, 'tr[data-function-id="echo"] .runs-1h') == "2")
            assert _text(browser, 'tr[data-function-id="echo"] .failed-1h') == "0 (0 %)"
            _shot(browser, "functions")

            # 5b. Invoke a function from its form with JSON data: a run with that data completes.
            echo_row = 'tr[data-function-id="echo"]'
            browser.find_element(By.CSS_SELECTOR, f"{echo_row} .invoke-data").send_keys('{"via": "the form"}')
            _click(browser, f"{echo_row} button.primary")
            _wait(browser, "the invoked run's link", lambda d: _count(d, f"{echo_row} .result a") == 1)
            invoked = _text(browser, f"{echo_row} .result a")
            await _run_status(http, invoked, "completed")
            assert (await http.get(f"/v1/runs/{invoked}")).json()["run"]["output"] == {
                "rendered": {"via": "the form"}, "count": 1}

            # 5c. Pause and resume a function from its row (docs/schedules.md).
            _click(browser, f"{echo_row} button.pause-toggle")
            _wait(browser, "the paused state", lambda d: "paused" in _text(d, f"{echo_row} td:nth-child(8)"))
            listed = (await http.get("/v1/functions")).json()["functions"]
            assert [f["paused_at"] is not None for f in listed if f["id"] == "echo"] == [True]
            _wait(browser, "the resume button", lambda d: _text(d, f"{echo_row} button.pause-toggle") == "Resume")
            _click(browser, f"{echo_row} button.pause-toggle")
            _wait(browser, "the active state", lambda d: _text(d, f"{echo_row} td:nth-child(8)").startswith("active"))
            listed = (await http.get("/v1/functions")).json()["functions"]
            assert [f["paused_at"] for f in listed if f["id"] == "echo"] == [None]

            # 6. Capacity needs a platform key: refused without, shown with one.
            browser.get(base + "/#/workers")
            _wait(browser, "the platform-key notice", lambda d: "platform key" in _text(d, "#view-error"))
            minted = subprocess.run(
                [sys.executable, "-m", "ironflow", "keys", "create", "--platform", "--db", str(db), "--json"],
                capture_output=True, text=True, check=True, cwd=ROOT,
            )
            browser.find_element(By.ID, "api-key").send_keys(json.loads(minted.stdout)["key"])
            _click(browser, "#access button.primary")
            _wait(browser, "the live worker session", lambda d: "stream" in _text(d, "#sessions-table"))
            held = (await http.post("/v1/events", json={"name": "dash.crash"})).json()["run_ids"][0]
            _wait(browser, "the held lease", lambda d: held in _text(d, "#leases-table"))
            assert _text(browser, "#leases-table .countdown").startswith("in "), "no expiry countdown"
            assert _text(browser, "#view-error") == ""
            _shot(browser, "workers")
            _no_script_ran(browser)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _steps(driver: Any) -> list[tuple[str, str]]:
    """The run page's step rows: (name, status badge) in the order shown."""
    return [(name, status) for name, status in driver.execute_script(
        "return [...document.querySelectorAll('#steps .step')].map("
        "(e) => [e.dataset.step, e.querySelector('.badge').innerText.trim()]);")]


async def _step_status(http: httpx.AsyncClient, run_id: str, step: str, wanted: str) -> None:
    with trio.fail_after(WAIT_S):
        while not any((s["name"], s["status"]) == (step, wanted)
                      for s in (await http.get(f"/v1/runs/{run_id}")).json()["steps"]):
            await trio.sleep(0.02)


def _ran(effects: Path, run_id: str) -> list[str]:
    """The steps the worker ran for ``run_id``, in order (tests/procs/resume_worker.py)."""
    lines = effects.read_text().splitlines() if effects.exists() else []
    return [line.split()[1] for line in lines if line.startswith(run_id)]


async def test_run_control_from_the_run_page_resumes_a_failed_run_from_its_failed_step_and_pauses_a_sleeping_run(
    browser: Any, tmp_path: Path
) -> None:
    """Run control from the dashboard (docs/run-control.md): step two fails
    while a flag file exists; with it gone, "Resume from failed step" runs two
    and three again, not one. A sleeping run paused from its page stays paused
    past its wake time, shows as paused in the runs list, and "Resume" ends it."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    effects, flag = tmp_path / "effects.txt", tmp_path / "flag"
    flag.touch()
    procs: list[Proc] = []
    try:
        procs.append(await start_node(str(tmp_path / "ironflow.db"), tmp_path / "state", tmp_path,
                                      node_id="node_rc", port=port))
        worker = Proc([sys.executable, str(RESUME_WORKER), base, str(effects), str(flag)], tmp_path / "w.log")
        procs.append(worker)
        await worker.wait_line("READY")
        async with httpx.AsyncClient(base_url=base, timeout=10.0) as http:
            failing = (await http.post("/v1/events", json={"name": "resume.go"})).json()["run_ids"][0]
            browser.get(f"{base}/#/runs/{failing}")
            _wait(browser, "the failed run", lambda d: _text(d, "#run-status") == "failed")
            _wait(browser, "its steps", lambda d: _steps(d) == [("one", "completed"), ("two", "failed")])
            assert _texts(browser, "#resume-from-step option") == [
                "from the failed step", "from step one", "from step two"]
            assert _count(browser, "#pause-run, #resume-run") == 0  # only what a failed run allows

            flag.unlink()
            _click(browser, "#resume-failed-run")
            _wait(browser, "the resume's answer", lambda d: "resumed (was failed) from step 'two'" in _text(d, "#action-result"))
            assert "1 step row deleted" in _text(browser, "#action-result")
            _wait(browser, "the resumed run completed", lambda d: _text(d, "#run-status") == "completed")
            _wait(browser, "every step completed", lambda d: _steps(d) == [
                ("one", "completed"), ("two", "completed"), ("three", "completed")])
            assert _ran(effects, failing) == ["one", "two", "two", "three"]  # one not run again
            detail = (await http.get(f"/v1/runs/{failing}")).json()["run"]
            assert (detail["output"], detail["attempt"]) == ([1, 2, 3], 1)
            assert _count(browser, "#pause-run, #resume-run, #resume-failed-run") == 0

            # A second resume (a completed run) is refused and changes nothing: the API says why.
            again = await http.post(f"/v1/runs/{failing}/resume", json={})
            assert again.status_code == 409 and "only a failed or paused run resumes" in again.json()["message"]

            # Pause a sleeping run from its page; its sleep ends, it stays paused. (The
            # API says when it sleeps: the page's 2 s poll could miss a short nap.)
            napping = (await http.post("/v1/events", json={"name": "pause.go", "data": {"nap": NAP_S}})).json()["run_ids"][0]
            browser.get(f"{base}/#/runs/{napping}")
            _wait(browser, "the pause button", lambda d: _count(d, "#pause-run") == 1)
            await _step_status(http, napping, "nap", "sleeping")
            _click(browser, "#pause-run")
            _wait(browser, "the paused run", lambda d: _text(d, "#run-status") == "paused")
            assert _text(browser, "#action-result").startswith("paused")
            _wait(browser, "why it waits", lambda d: "until resumed" in _text(d, "#waiting-reason"))
            await wait_for_step(http, napping, "nap")  # the sleep ended while paused
            paused = (await http.get(f"/v1/runs/{napping}")).json()
            assert paused["run"]["status"] == "paused" and paused["queue"] is None and paused["lease"] is None
            assert _ran(effects, napping) == ["one"]

            browser.get(f"{base}/#/runs?status=paused")
            row = f'tr[data-run-id="{napping}"]'
            _wait(browser, "the paused run in the list", lambda d: _count(d, "tr.run-row") == 1 and _count(d, row) == 1)
            assert _text(browser, f"{row} .badge") == "paused"

            _click(browser, f"{row} a")
            _wait(browser, "the resume button", lambda d: _count(d, "#resume-run") == 1)
            _click(browser, "#resume-run")
            _wait(browser, "the resume's answer", lambda d: "resumed (was paused)" in _text(d, "#action-result"))
            _wait(browser, "the run completed", lambda d: _text(d, "#run-status") == "completed")
            assert _ran(effects, napping) == ["one", "two"]
            assert _steps(browser) == [("one", "completed"), ("nap", "completed"), ("two", "completed")]
    finally:
        for proc in reversed(procs):
            proc.stop()


async def test_without_dev_the_page_asks_for_a_key_keeps_it_for_the_tab_and_says_what_it_cannot_see(
    browser: Any, tmp_path: Path
) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    db = tmp_path / "ironflow.db"
    node = Proc(
        [sys.executable, "-m", "ironflow", "serve", "--db", str(db), "--port", str(port),
         "--node-id", "node_keys", "--state-dir", str(tmp_path / "state")],
        tmp_path / "node.log",
    )
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10.0) as http:
            with trio.fail_after(30):
                while True:
                    try:
                        if (await http.get("/readyz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.1)
            assert (await http.get("/v1/runs")).status_code == 401  # not a --dev node
            minted = subprocess.run(
                [sys.executable, "-m", "ironflow", "keys", "create", "--db", str(db), "--json"],
                capture_output=True, text=True, check=True, cwd=ROOT,
            )
            org_key = json.loads(minted.stdout)["key"]

            browser.get(base + "/#/runs")
            _wait(browser, "the key prompt", lambda d: "needs an API key" in _text(d, "#notice"))
            assert _count(browser, "#runs-table") == 0  # nothing shown without a key
            browser.find_element(By.ID, "api-key").send_keys(org_key)
            _click(browser, "#access button.primary")
            _wait(browser, "the runs table", lambda d: "No runs yet." in _text(d, "#runs-table"))
            assert _text(browser, "#access").startswith(f"key …{org_key[-4:]}")

            # Kept for the tab: a reload still has it; it never reaches localStorage.
            browser.refresh()
            _wait(browser, "the runs table after a reload", lambda d: "No runs yet." in _text(d, "#runs-table"))
            assert browser.execute_script("return window.localStorage.length") == 0

            # An org key may not see capacity: the page says so.
            browser.get(base + "/#/workers")
            _wait(browser, "the platform-key notice", lambda d: "platform key" in _text(d, "#view-error"))

            # Forgetting the key asks for one again.
            _click(browser, "#access button")
            _wait(browser, "the key prompt again", lambda d: d.find_elements(By.ID, "api-key"))
            assert browser.execute_script("return window.sessionStorage.length") == 0
    finally:
        node.stop()
