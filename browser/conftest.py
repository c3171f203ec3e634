"""The chat page in a real headless Chromium (``make browser``).

The browser is Debian's ``chromium`` driven through its ``chromium-driver`` by Selenium;
nothing is downloaded at test time. Without them the suite does not pass quietly:
collection stops with an error that says what to install. Screenshots go to
``$BROWSER_SCREENSHOTS`` (default ``browser/screenshots/``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # (the unit suite's server helpers, shared)

#: Debian's browser and its driver, unless the environment names others.
CHROMIUM = os.environ.get("CHROMIUM", "chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "chromedriver")


def pytest_configure(config: pytest.Config) -> None:
    missing = [name for name in (CHROMIUM, CHROMEDRIVER) if shutil.which(name) is None]
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium (pip install -e '.[dev]')")
    if missing:
        raise pytest.UsageError(
            f"make browser needs a real Chromium: missing {', '.join(missing)} "
            "(Debian: apt-get install chromium chromium-driver)")


@pytest.fixture(scope="session")
def screenshots() -> Path:
    folder = Path(os.environ.get("BROWSER_SCREENSHOTS", REPO / "browser" / "screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    model = REPO / "model"
    if not (model / "config.json").is_file():
        raise pytest.UsageError("make browser serves the embedded model: run make model first")
    return model


@pytest.fixture(scope="session")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1100,850"):
        options.add_argument(argument)
    os.environ.setdefault("SE_OFFLINE", "true")  # (Selenium Manager: never download)
    driver = webdriver.Chrome(service=Service(shutil.which(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()
