"""The web page at / in a real headless Chromium (Debian's chromium + chromium-driver, driven
by Selenium): chat through the page, and the KV gauge drawn from the server's own counters."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from _server import config, running

from edgekv.server import App, Settings

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

NO_BROWSER = "no browser: install Debian's chromium and chromium-driver (scripts/setup.sh does)"


@pytest.fixture
def browser(tmp_path):
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        if os.environ.get("CI") == "true":  # CI installs them: a missing browser is a failure there
            pytest.fail(NO_BROWSER)
        pytest.skip(NO_BROWSER)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,800"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def test_chat_in_the_page_and_the_gauge_follows_the_cache(smollm2, tmp_path, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    app = App(config(smollm2, tmp_path / "state", defaults=Settings("knorm", 128), n_ctx=192, max_tokens=64))
    with running(app) as base:
        browser.get(base + "/")
        wait = WebDriverWait(browser, 120)
        wait.until(lambda d: d.find_element(By.ID, "model").text == "smollm2-135m")
        assert browser.find_element(By.ID, "method").get_attribute("value") == "knorm"
        questions = ["Tell me a short story about a fox who lives in a forest near a river. " * 3,
                     "What did the fox do next? Describe it in detail.",
                     "And then? Tell me how the story ends, with every detail."]
        for turn, q in enumerate(questions, 1):
            box = browser.find_element(By.ID, "msg")
            box.send_keys(q)
            browser.find_element(By.ID, "send").click()
            wait.until(lambda d, t=turn: d.find_element(By.TAG_NAME, "body").get_attribute("data-turns") == str(t))
        replies = browser.find_elements(By.CSS_SELECTOR, ".m.assistant")
        assert len(replies) == 3 and all(r.text.strip() for r in replies)
        assert not browser.find_elements(By.CSS_SELECTOR, ".m.error")
        # the page shows the engine's numbers: one conversation, continued across both turns
        (conv,) = app.store.convs.values()
        assert conv.requests == 3
        cells = conv.session.engine.n_cells
        assert browser.find_element(By.ID, "cells").text == str(cells)
        assert browser.find_element(By.ID, "compressions").text == str(conv.session.stats.compressions)
        assert conv.session.stats.compressions >= 1
        # the gauge is drawn to scale, and each compression is listed with what it removed
        fill = float(browser.find_element(By.ID, "gauge-fill").get_attribute("width"))
        assert fill == pytest.approx(360 * cells / 192, abs=0.1)
        events = browser.find_elements(By.CSS_SELECTOR, "#events li")
        assert len(events) == conv.session.stats.compressions and "evicted" in events[0].text
        assert len(browser.find_element(By.ID, "cells-line").get_attribute("points").split()) > 3
        shot = tmp_path / "page.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get("EDGEKV_SCREENSHOT"):  # docs/serve-page.png is made this way
            shutil.copy(shot, os.environ["EDGEKV_SCREENSHOT"])
