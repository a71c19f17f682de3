"""``.ci/run`` installs Debian's chromium only when it is missing and it can (root, apt-get), and a
failed or impossible install never fails CI; the gate (``make lint``, ``make typecheck``) and
``make test-all`` run in every case and their status is CI's. Every command the script calls is a
stub on a private PATH."""

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("bash", "dirname")  # the real programs the script needs besides the stubs
GATE_AND_TESTS = ["make lint", "make typecheck", "make test-all"]  # what CI runs, in order


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f'#!/bin/bash\necho "{name} $*" >> "$CALLS"\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_ci(tmp_path: Path, *, uid: int, apt: str | None, chromium: bool, make_status: int = 0):
    """Run a copy of .ci/run with stubs; returns (completed process, the stub calls in order)."""
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    bin_dir.mkdir()
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", repo / ".ci" / "run")
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    stub(bin_dir, "id", f"echo {uid}")
    stub(bin_dir, "make", f"exit {make_status}")
    if chromium:
        stub(bin_dir, "chromium", "")
    if apt == "works":  # installing puts a chromium on PATH
        stub(
            bin_dir,
            "apt-get",
            f'[ "$1" = install ] && printf "#!/bin/bash\\n" > {bin_dir}/chromium '
            f"&& chmod +x {bin_dir}/chromium; exit 0",
        )
    elif apt == "fails":
        stub(bin_dir, "apt-get", "echo 'E: Unable to locate package chromium' >&2; exit 100")
    calls = tmp_path / "calls"
    calls.touch()
    done = subprocess.run(
        ["bash", str(repo / ".ci" / "run")],
        env={"PATH": str(bin_dir), "CALLS": str(calls)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, calls.read_text().splitlines()


def test_root_with_apt_installs_chromium_then_tests(tmp_path):
    done, calls = run_ci(tmp_path, uid=0, apt="works", chromium=False)
    assert done.returncode == 0, done.stderr
    assert [c for c in calls if c != "id -u"] == [
        "apt-get update",
        "apt-get install -y chromium",
        *GATE_AND_TESTS,
    ]
    assert (tmp_path / "bin" / "chromium").exists()


def test_an_installed_chromium_is_left_alone(tmp_path):
    done, calls = run_ci(tmp_path, uid=0, apt="works", chromium=True)
    assert done.returncode == 0 and calls == GATE_AND_TESTS


@pytest.mark.parametrize("uid, apt", [(1000, "works"), (0, None)])
def test_without_root_or_apt_ci_still_tests_and_says_the_browser_tests_skip(tmp_path, uid, apt):
    done, calls = run_ci(tmp_path, uid=uid, apt=apt, chromium=False)
    assert done.returncode == 0
    assert not any(c.startswith("apt-get") for c in calls) and calls[-3:] == GATE_AND_TESTS
    assert (
        "chromium is missing and apt-get as root is unavailable: the browser tests will skip"
        in done.stderr
    )


def test_a_failed_install_does_not_fail_ci(tmp_path):
    done, calls = run_ci(tmp_path, uid=0, apt="fails", chromium=False)
    assert done.returncode == 0
    assert calls[-3:] == GATE_AND_TESTS
    assert "apt-get install chromium failed: the browser tests will skip" in done.stderr


def test_a_failing_gate_fails_ci_before_the_tests(tmp_path):
    done, calls = run_ci(tmp_path, uid=0, apt=None, chromium=True, make_status=2)
    assert done.returncode != 0 and calls == ["make lint"]


def test_make_test_installs_the_dev_and_demo_extras(tmp_path):
    """On a clean clone (no environment yet) ``make test`` installs ``.[dev,demo]`` first, at the
    pinned versions of the constraints file."""
    dry = subprocess.run(
        ["make", "-n", "test", f"VENV={tmp_path / 'venv'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    install = '-m pip install --quiet -c requirements/constraints.txt -e ".[dev,demo]"'
    assert f"{tmp_path / 'venv'}/bin/python {install}" in dry.stdout


def test_the_demo_extra_names_gradio_and_its_client():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    demo = [
        requirement.split(">")[0].split("=")[0]
        for requirement in project["optional-dependencies"]["demo"]
    ]
    assert demo == ["gradio", "gradio_client"]
    assert not any(
        name.startswith("gradio") for name in project["dependencies"]
    )  # the core stays light
