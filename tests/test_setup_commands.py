"""The README's two commands set up what they need: the Makefile's Debian packages step, tried with the package
manager taken away (the branch that must stop and say what to type), and with nothing missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")


def run_make(target: str, path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MAKE, "-s", "-C", str(ROOT), target, *args], capture_output=True, text=True,
                          env={**os.environ, "PATH": path}, timeout=60)


@pytest.fixture
def bare_path(tmp_path) -> str:
    """A PATH with a shell and the few tools the step uses, but no npm, bwrap, apt-get or sudo."""
    for tool in ("sh", "id", "echo", "true"):
        if (found := shutil.which(tool)) is not None:
            (tmp_path / tool).symlink_to(found)
    return str(tmp_path)


@pytest.mark.skipif(MAKE is None, reason="needs GNU make, which the README's commands run")
def test_without_a_package_manager_make_stops_and_says_what_to_do(bare_path):
    done = run_make("system-test", bare_path)
    assert done.returncode != 0
    assert "make test needs:" in done.stdout and "npm" in done.stdout and "bubblewrap" in done.stdout, done.stdout
    assert "SYSTEM_PACKAGES=skip" in done.stdout
    book = run_make("system-book", bare_path)
    assert book.returncode != 0 and "make book needs: npm" in book.stdout, book.stdout
    assert run_make("system-test", bare_path, "SYSTEM_PACKAGES=skip").returncode == 0


@pytest.mark.skipif(MAKE is None or not all(shutil.which(t) for t in ("npm", "bwrap")) or
                    not Path("/usr/bin/chromium").exists(), reason="the packages are not installed here")
def test_with_everything_installed_the_step_does_nothing():
    done = run_make("system-test", os.environ["PATH"])
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr
