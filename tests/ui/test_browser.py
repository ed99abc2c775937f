"""The viewer in a real browser: headless Chromium (Debian's packages, driven by Selenium) walks
the pages of a store the demo wrote, the way a new user would after `trace-proxy demo`, and
a run's drifting calls (a text client's real traffic, tests/support/drift_traffic.py).

Screenshots of every page are kept in `$TRACE_PROXY_TEST_ARTIFACTS/ui-screenshots/` when that
is set, else in pytest's temporary directory (`pytest-of-<user>/pytest-<n>/ui-screenshots0/`).
Chromium is installed by `.ci/run` when missing; elsewhere the test is skipped without it, and
fails without it when `TRACE_PROXY_REQUIRE_BROWSER` is set (CI sets it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from support import version_workload
from support.drift_traffic import TURNS, text_client_rollout
from support.proxies import running_proxy

from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer
from trace_proxy.store.readers import iter_records
from trace_proxy.trajectories.prompts import transcript_of

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
WAIT = 30.0  # seconds a page may take on two busy cores


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not (CHROMIUM and CHROMEDRIVER):
        reason = ("headless Chromium is not installed "
                  "(apt-get install chromium chromium-driver; .ci/run installs it)")  # fmt: skip
        if os.environ.get("TRACE_PROXY_REQUIRE_BROWSER"):
            pytest.fail(reason)
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `trace-proxy demo` writes, and its hint to look at it in the browser."""
    home = tmp_path_factory.mktemp("ui-demo")
    demo = subprocess.run(
        [sys.executable, "-m", "trace_proxy", "demo", "--output", "traces"],
        capture_output=True, text=True, timeout=180, cwd=home,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    assert "In a browser:  trace-proxy ui traces" in demo.stdout
    return home / "traces"


@contextlib.contextmanager
def served(store: Path) -> Iterator[str]:
    """`trace-proxy ui STORE --port 0 --tokenizer DIR`, as a user starts it; its URL from what
    it prints."""
    tokenizer = str(ensure_qwen_tokenizer())
    process = subprocess.Popen(
        [sys.executable, "-m", "trace_proxy", "ui", str(store), "--port", "0",
         "--tokenizer", tokenizer],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    stdout = process.stdout
    assert stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
    try:
        printed = ""
        while "http://" not in printed:
            printed += lines.get(timeout=90)  # a line at a time, as they are printed
        found = re.search(r"(http://127\.0\.0\.1:\d+/)", printed)
        assert found, printed
        yield found.group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def viewer_url(demo_store: Path) -> Iterator[str]:
    with served(demo_store) as url:
        yield url


@pytest.fixture(scope="module")
def drift_store(qwen_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding a text client's drifting trajectory (tests/support/drift_traffic.py)."""
    output = tmp_path_factory.mktemp("ui-drift")
    asyncio.run(text_client_rollout(qwen_tokenizer, output))
    return output


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("TRACE_PROXY_TEST_ARTIFACTS")
    if configured:
        path = Path(configured) / "ui-screenshots"
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("ui-screenshots")


def test_a_new_user_finds_the_best_and_worst_rollout_and_where_they_diverge(
    browser: object, viewer_url: str, demo_store: Path, shots: Path, qwen_tokenizer: Any
) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    driver = browser
    wait = WebDriverWait(driver, WAIT)
    stored = {r["id"]: r for _, r in iter_records(demo_store) if r.get("record") == "trajectory"}

    def shot(name: str) -> None:
        assert driver.save_screenshot(str(shots / f"{name}.png"))

    def text(css: str) -> str:
        return str(driver.find_element(By.CSS_SELECTOR, css).text)

    # Runs: the demo's one run, with its counts.
    driver.get(viewer_url)
    row = driver.find_element(By.CSS_SELECTOR, "#runs tbody tr")
    assert "default" in row.text and "16" in row.text
    shot("01-runs")
    driver.find_element(By.CSS_SELECTOR, "a.run-link").click()

    # Steps of the run: two training steps, plots across them.
    wait.until(ec.presence_of_element_located((By.ID, "train-steps")))
    steps = driver.find_elements(By.CSS_SELECTOR, "#train-steps tbody tr")
    assert [s.find_element(By.TAG_NAME, "a").text for s in steps] == ["1", "2"]
    assert len(driver.find_elements(By.CSS_SELECTOR, "figure.plot svg polyline")) == 3
    shot("02-steps")
    steps[0].find_element(By.TAG_NAME, "a").click()

    # A step: GRPO groups as rows, rollouts side by side, best and worst marked.
    wait.until(ec.presence_of_element_located((By.ID, "groups")))
    groups = driver.find_elements(By.CSS_SELECTOR, "#groups tr.group")
    assert [g.get_attribute("data-group") for g in groups] == [f"sample {i}" for i in range(4)]
    assert all(len(g.find_elements(By.CSS_SELECTOR, "td.rollout")) == 2 for g in groups)
    # Each group says what its sample asks; the whole prompt opens from it.
    asks = [g.find_element(By.CSS_SELECTOR, "details.gprompt summary").text for g in groups]
    assert all(asks) and len(set(asks)) == len(asks), asks
    groups[0].find_element(By.CSS_SELECTOR, "details.gprompt summary").click()
    whole = groups[0].find_element(By.CSS_SELECTOR, "details.gprompt .full-prompt")
    assert whole.is_displayed() and whole.text.startswith(asks[0].removesuffix("…"))
    mixed = [g for g in groups if g.find_elements(By.CSS_SELECTOR, "a.compare-best-worst")]
    assert mixed, "the demo's verifier gives some group's rollouts different rewards"
    group = mixed[0]
    best = float(group.find_element(By.CSS_SELECTOR, "td.best").get_attribute("data-reward"))
    worst = float(group.find_element(By.CSS_SELECTOR, "td.worst").get_attribute("data-reward"))
    assert best > worst
    shot("03-step")
    group.find_element(By.CSS_SELECTOR, "a.compare-best-worst").click()

    # Compare: the two side by side, the first divergence marked in the page.
    wait.until(ec.presence_of_element_located((By.ID, "compare")))
    assert text("#divergence").startswith("First divergence: turn")
    rewards = [float(r.text.split()[-1]) for r in
               driver.find_elements(By.CSS_SELECTOR, "#compare thead .reward")]  # fmt: skip
    assert rewards == [best, worst]
    marker = driver.find_element(By.CSS_SELECTOR, "#first-divergence mark.diverge")
    assert marker.is_displayed()
    shot("04-compare")
    driver.find_element(By.CSS_SELECTOR, "#compare thead a.traj-link").click()

    # A trajectory turn by turn, as the store holds it.
    wait.until(ec.presence_of_element_located((By.ID, "traj-title")))
    ident = driver.current_url.rstrip("/").rsplit("/", 1)[-1]
    record = stored[ident]
    assert float(text("#traj-reward").split()[0]) == best == record["reward"]
    assert len(driver.find_elements(By.CSS_SELECTOR, "section.turn")) == len(record["calls"])
    spans = driver.find_elements(By.CSS_SELECTOR, "svg.timeline g.span")
    assert len(spans) == len(record["calls"]) + len(record["tools"])
    specials = {s.get_attribute("textContent") for s in
                driver.find_elements(By.CSS_SELECTOR, "pre.response .special")}  # fmt: skip
    assert "<|im_end|>" in specials
    first_response = driver.find_element(By.CSS_SELECTOR, "#turn-0 pre.response")
    first_output = record["calls"][0]["outputs"][0]
    assert first_response.get_attribute("textContent") == first_output["response_text"]
    transcript = driver.find_element(By.CSS_SELECTOR, "#transcript pre")
    assert transcript.get_attribute("textContent") == transcript_of(record)
    driver.find_element(By.CSS_SELECTOR, "#turn-0 details.logprobs summary").click()
    token = driver.find_element(By.CSS_SELECTOR, "#turn-0 .tokens .tok")
    ActionChains(driver).move_to_element(token).perform()
    first_logprob = first_output["logprobs"][0]
    assert f"logprob {first_logprob:.4g}" in token.get_attribute("title")
    first_token = first_output["token_ids"][0]
    assert token.get_attribute("textContent") == qwen_tokenizer.decode([first_token])
    shot("05-trajectory")
    driver.find_element(By.ID, "raw-link").click()
    raw = orjson.loads(driver.find_element(By.TAG_NAME, "body").text)
    assert raw["id"] == ident and raw["calls"] == record["calls"]
    driver.back()

    # Filters: a text search keeps the one group whose task mentions London.
    wait.until(ec.presence_of_element_located((By.ID, "traj-title")))
    driver.find_element(By.CSS_SELECTOR, "nav.crumbs a:nth-of-type(3)").click()
    search = wait.until(ec.presence_of_element_located((By.NAME, "q")))
    search.send_keys("London")
    search.submit()
    wait.until(ec.url_contains("q=London"))
    groups = driver.find_elements(By.CSS_SELECTOR, "#groups tr.group")
    assert [g.get_attribute("data-group") for g in groups] == ["sample 2"]
    shot("06-step-search")

    # A proxy still writing: a new step shows up, announced on the open page.
    driver.find_element(By.CSS_SELECTOR, "nav.crumbs a:nth-of-type(2)").click()
    wait.until(ec.presence_of_element_located((By.ID, "train-steps")))
    new = dict(next(iter(stored.values())))
    new["id"] = uuid.uuid4().hex
    new["key"] = {**new["key"], "step": 3}
    with open(demo_store / "default" / "demo" / "step-000003.jsonl", "ab") as handle:
        handle.write(orjson.dumps(new) + b"\n")
    wait.until(ec.visibility_of_element_located((By.ID, "fresh")))
    driver.find_element(By.ID, "reload").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#train-steps tbody tr")) == 3)
    shot("07-steps-followed")


def test_a_user_follows_one_prompt_across_training(
    browser: object, viewer_url: str, demo_store: Path, shots: Path
) -> None:
    """From a group of a step to the same prompt at every step where it was kept: rewards and
    the best and worst answers of each step, each answer opening its trajectory."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    driver = browser
    wait = WebDriverWait(driver, WAIT)
    driver.get(viewer_url)
    driver.find_element(By.CSS_SELECTOR, "a.run-link").click()
    wait.until(ec.presence_of_element_located((By.ID, "train-steps")))
    driver.find_element(By.CSS_SELECTOR, "#train-steps tbody tr a").click()
    group = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#groups tr.group")))
    asks = group.find_element(By.CSS_SELECTOR, "details.gprompt summary").text.removesuffix("…")
    sample = group.get_attribute("data-group")
    # The store as written: the steps where this group's first user message was asked.
    records = [r for _, r in iter_records(demo_store) if r.get("record") == "trajectory"]

    def asked(record: dict[str, Any]) -> str:
        messages = record["calls"][0]["prompt"]["messages"]
        return next(m["content"] for m in messages if m["role"] == "user")

    steps = sorted({r["key"]["step"] for r in records if asked(r).startswith(asks)})
    assert len(steps) >= 2, "the demo asks its samples again at the next step"
    link = group.find_element(By.CSS_SELECTOR, "a.prompt-history")
    assert link.text == f"this prompt at {len(steps)} steps"
    link.click()

    wait.until(ec.presence_of_element_located((By.ID, "history")))
    assert driver.find_element(By.CSS_SELECTOR, "#history-prompt .full-prompt").text.startswith(
        asks
    )
    rows = driver.find_elements(By.CSS_SELECTOR, "#history tr.history-step")
    assert [r.get_attribute("data-step") for r in rows] == [str(s) for s in steps]
    assert len(driver.find_elements(By.CSS_SELECTOR, "figure.plot svg polyline")) == 2
    best = rows[0].find_element(By.CSS_SELECTOR, "td.answer.best")
    answer = best.find_element(By.CSS_SELECTOR, "pre.response").get_attribute("textContent")
    assert driver.save_screenshot(str(shots / "08-prompt-history.png"))
    best.find_element(By.CSS_SELECTOR, "a.traj-link").click()
    wait.until(ec.presence_of_element_located((By.ID, "traj-title")))
    ident = driver.current_url.rstrip("/").rsplit("/", 1)[-1]
    record = next(r for r in records if r["id"] == ident)
    assert record["key"]["step"] == steps[0] == 1  # the step the group was on
    assert f"sample {record['key']['sample_index']}" == sample
    last = record["calls"][-1]["outputs"][0]
    assert answer.startswith((last.get("response_text") or last.get("text") or "")[:200])


def test_drifting_calls_are_listed_and_marked(
    browser: object, drift_store: Path, shots: Path
) -> None:
    """From the run to its drifting calls, each with its first differing token, and from one
    to its trajectory, where the drifting turn is marked."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    driver = browser
    wait = WebDriverWait(driver, WAIT)
    [record] = [r for _, r in iter_records(drift_store) if r.get("record") == "trajectory"]
    prefix = record["calls"][0]["drift"]["prefix"]
    with served(drift_store) as url:
        driver.get(url)
        driver.find_element(By.CSS_SELECTOR, "a.run-link").click()
        notice = wait.until(ec.visibility_of_element_located((By.ID, "run-drift")))
        assert notice.text.startswith("1 trajectory with drifting calls")
        notice.find_element(By.TAG_NAME, "a").click()

        wait.until(ec.presence_of_element_located((By.ID, "drift-list")))
        rows = driver.find_elements(By.CSS_SELECTOR, "#drift-list tr.drift-row")
        assert len(rows) == TURNS
        marks = rows[0].find_elements(By.CSS_SELECTOR, ".drift-mark")
        assert [m.get_attribute("data-kind") for m in marks] == ["prefix", "roundtrip"]
        tokens = [t.text for t in marks[0].find_elements(By.CSS_SELECTOR, "code.token")]
        assert tokens == [
            f"{prefix['expected']} {json.dumps(prefix['expected_text'])}",
            f"{prefix['got']} {json.dumps(prefix['got_text'])}",
        ]
        assert all(m.is_displayed() for m in marks)
        assert driver.save_screenshot(str(shots / "09-drift.png"))
        rows[0].find_element(By.TAG_NAME, "a").click()

        wait.until(ec.presence_of_element_located((By.ID, "traj-title")))
        assert driver.current_url.endswith("#turn-0")
        assert text_of(driver, "#traj-drift").startswith(f"{TURNS} drifting calls")
        marked = driver.find_elements(By.CSS_SELECTOR, "section.turn.drifting")
        assert [m.get_attribute("id") for m in marked] == [f"turn-{i}" for i in range(TURNS)]
        first = driver.find_element(By.CSS_SELECTOR, "#turn-0 .drift-mark[data-kind=prefix]")
        assert first.is_displayed() and f"at its token {prefix['at']}" in first.text
        assert f"{prefix['got']} {json.dumps(prefix['got_text'])}" in first.text
        assert driver.save_screenshot(str(shots / "10-drift-trajectory.png"))


def text_of(driver: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def test_a_user_searches_every_step_of_a_run_and_opens_a_result(
    browser: object, viewer_url: str, demo_store: Path, shots: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    driver = browser
    wait = WebDriverWait(driver, WAIT)
    stored = {r["id"]: r for _, r in iter_records(demo_store) if r.get("record") == "trajectory"}
    rewarded = {i for i, r in stored.items() if b"London" in orjson.dumps(r)
                and (r.get("reward") or 0) >= 1}  # fmt: skip
    assert rewarded, "the demo answers the London task well at least once"

    # The run page's form: words and a reward range, over every step.
    driver.get(viewer_url)
    driver.find_element(By.CSS_SELECTOR, "a.run-link").click()
    form = wait.until(ec.presence_of_element_located((By.ID, "search-form")))
    form.find_element(By.NAME, "q").send_keys("london")
    form.find_element(By.NAME, "min_reward").send_keys("1")
    form.find_element(By.ID, "search-submit").click()
    wait.until(ec.presence_of_element_located((By.ID, "search-count")))
    assert "q=london" in driver.current_url and "min_reward=1" in driver.current_url
    rows = driver.find_elements(By.CSS_SELECTOR, "#search-results tr.result")
    links = [r.find_element(By.CSS_SELECTOR, "a.result-link") for r in rows]
    found = {str(a.get_attribute("href")).rsplit("/", 1)[-1] for a in links}
    assert found == rewarded
    marks = driver.find_elements(By.CSS_SELECTOR, "#search-results td.snippet mark")
    assert marks and all(m.text.lower() == "london" and m.is_displayed() for m in marks)
    driver.save_screenshot(str(shots / "11-run-search.png"))

    # A result opens its trajectory.
    links[0].click()
    wait.until(ec.presence_of_element_located((By.ID, "traj-title")))
    assert driver.current_url.rsplit("/", 1)[-1] in rewarded


def test_a_replay_is_compared_with_what_was_recorded(
    browser: object, demo_store: Path, shots: Path, qwen_tokenizer: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    """`trace-proxy replay` sends a recorded trajectory to a server again; in the viewer the
    new run's trajectory opens a comparison with the recorded one, side by side."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from trace_proxy.demo.simulated_vllm import SimulatedVLLM

    assert isinstance(browser, WebDriver)
    driver = browser
    wait = WebDriverWait(driver, WAIT)
    store = tmp_path / "traces"
    shutil.copytree(demo_store, store)
    recorded = next(
        r for _, r in iter_records(store)
        if r.get("record") == "trajectory" and r["key"]["step"] == 1 and len(r["calls"]) > 1
    )  # fmt: skip
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = SimulatedVLLM(qwen_tokenizer, model="qwen-sim")
    runner, upstream = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    try:
        replay = subprocess.run(
            [sys.executable, "-m", "trace_proxy", "replay", str(store), "--upstream", upstream,
             "--trajectory", recorded["id"]],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
    assert replay.returncode == 0, replay.stderr
    with served(store) as url:
        driver.get(url)
        runs = driver.find_elements(By.CSS_SELECTOR, "a.run-link")
        [new_run] = [r for r in runs if "replay" in r.text]
        new_run.click()
        wait.until(ec.presence_of_element_located((By.ID, "train-steps"))).find_element(
            By.CSS_SELECTOR, "tbody tr a"
        ).click()
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "a.traj-link"))).click()
        wait.until(ec.presence_of_element_located((By.ID, "compare-recorded"))).click()

        wait.until(ec.presence_of_element_located((By.ID, "compare")))
        heads = driver.find_elements(By.CSS_SELECTOR, "#compare thead a.traj-link")
        assert len(heads) == 2
        assert str(heads[0].get_attribute("href")).endswith(f"/t/{recorded['id']}")
        assert driver.find_element(By.CSS_SELECTOR, "#compare thead .tag.recorded").is_displayed()
        rows = driver.find_elements(By.CSS_SELECTOR, "#compare tbody > tr")
        assert len(rows) == len(recorded["calls"])  # the same calls, turn by turn
        # The same simulated model answers alike; the recorded side was decoded to text and
        # the replayed one was not, so they are compared as sent, not as shown.
        assert driver.find_element(By.ID, "divergence").text == "These rollouts do not differ."
        assert driver.save_screenshot(str(shots / "12-replay-compare.png"))


@pytest.fixture(scope="module")
def async_store(qwen_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real proxy's store of a partial rollout resumed across a weight sync and a rollout
    on one version, closed one sync later (tests/support/version_workload.py)."""
    output = tmp_path_factory.mktemp("ui-async") / "traces"

    async def run() -> None:
        async with version_workload.upstream(qwen_tokenizer) as url:
            async with running_proxy([url], output) as (_, proxy):
                async with aiohttp.ClientSession() as session:
                    await version_workload.partial_rollouts(session, proxy, qwen_tokenizer)

    asyncio.run(run())
    return output


def test_a_user_sees_how_stale_an_asynchronous_runs_samples_were(
    browser: object, async_store: Path, shots: Path
) -> None:
    """The run's samples by versions spanned and behind at close, then a step's partial
    rollouts alone, then the partial rollout's timeline with the weight sync between its
    attempts."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    assert isinstance(browser, WebDriver)
    driver = browser
    wait = WebDriverWait(driver, WAIT)
    records = version_workload.by_sample(
        [r for _, r in iter_records(async_store) if r.get("record") == "trajectory"]
    )
    with served(async_store) as url:
        driver.get(url)
        driver.find_element(By.CSS_SELECTOR, "a.run-link").click()
        plots = wait.until(ec.visibility_of_element_located((By.ID, "version-plots")))
        lag = plots.find_elements(By.CSS_SELECTOR, "#version-lag rect.bar")
        assert [(b.get_attribute("data-value"), b.get_attribute("data-count")) for b in lag] == [
            ("0", "0"), ("1", "2")]  # fmt: skip
        tall = lag[1]
        assert tall.is_displayed() and tall.size["height"] > 0 and lag[0].size["height"] == 0
        spread = plots.find_elements(By.CSS_SELECTOR, "#version-spread rect.bar")
        assert [b.get_attribute("data-count") for b in spread] == ["1", "1"]
        assert driver.save_screenshot(str(shots / "13-version-plots.png"))
        driver.find_element(By.CSS_SELECTOR, "#train-steps a.step-link").click()

        wait.until(ec.presence_of_element_located((By.ID, "groups")))
        assert len(driver.find_elements(By.CSS_SELECTOR, "td.rollout")) == 2
        Select(driver.find_element(By.ID, "partial")).select_by_visible_text("only partial")
        driver.find_element(By.CSS_SELECTOR, "#filters button[type=submit]").click()
        wait.until(ec.url_contains("partial=yes"))
        [cell] = driver.find_elements(By.CSS_SELECTOR, "td.rollout")
        assert cell.get_attribute("data-id") == records[0]["id"]
        assert cell.find_element(By.CSS_SELECTOR, ".partial-tag").is_displayed()
        assert driver.save_screenshot(str(shots / "14-partial-rollouts.png"))
        cell.find_element(By.CSS_SELECTOR, "a.traj-link").click()

        wait.until(ec.presence_of_element_located((By.ID, "traj-title")))
        assert text_of(driver, "#traj-versions") == (
            "versions 3 to 4, partial rollout; newest at close 5 (1 behind)"
        )
        assert driver.save_screenshot(str(shots / "15-weight-sync.png"))
        [sync] = driver.find_elements(By.CSS_SELECTOR, "svg.timeline g.sync")
        label = sync.find_element(By.TAG_NAME, "text")
        assert label.text == "v3 → v4" and label.is_displayed()
        attempts = driver.find_elements(By.CSS_SELECTOR, "svg.timeline g.segment rect")
        line = sync.find_element(By.TAG_NAME, "line")  # vertical: drawn, though 0 wide
        assert len(attempts) == 2 and line.rect["height"] > 0
        # On the page as drawn: the sync between the end of the first attempt and the second.
        first, second = attempts
        assert first.rect["x"] + first.rect["width"] <= line.rect["x"] <= second.rect["x"] + 1
