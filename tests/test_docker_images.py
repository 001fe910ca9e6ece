"""deploy/docker: no image is built here (no container engine), so each Dockerfile is parsed and
held to what the deployment relies on: multi-stage, every base image pinned (no `latest`), the
final stage running as a non-root user, no HEALTHCHECK (Kubernetes probes), torch pinned to the
version scripts/setup.sh installs, OCI labels, and every COPY source present in the build context
that .dockerignore leaves."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("Dockerfile.*"))
OCI_LABELS = ("title", "description", "version", "revision", "licenses")


@dataclass
class Stage:
    image: str  # as written after FROM, ARGs substituted
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, instruction: str) -> list[str]:
        return [rest for name, rest in self.instructions if name == instruction]


@dataclass
class Dockerfile:
    args: dict[str, str]  # ARGs declared before the first FROM, with their defaults
    stages: list[Stage]

    def text_of(self, instruction: str) -> str:
        return "\n".join(rest for stage in self.stages for rest in stage.all(instruction))


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs: comments dropped, continuation lines joined."""
    found, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        found.append((keyword.upper(), rest.strip()))
        pending = ""
    return found


def parse(path: Path) -> Dockerfile:
    parsed = Dockerfile({}, [])
    for keyword, rest in instructions(path.read_text()):
        if keyword == "ARG" and not parsed.stages:
            name, _, default = rest.partition("=")
            parsed.args[name] = default
        elif keyword == "FROM":
            words = re.sub(r"\$\{(\w+)\}", lambda m: parsed.args[m.group(1)], rest).split()
            image = next(w for w in words if not w.startswith("--"))
            name = words[words.index("AS") + 1] if "AS" in words else None
            parsed.stages.append(Stage(image, name))
        else:
            assert parsed.stages, f"{path.name}: {keyword} before the first FROM"
            parsed.stages[-1].instructions.append((keyword, rest))
    return parsed


def setup_torch_version() -> str:
    (version,) = re.findall(r"torch==([\w.+]+)", (ROOT / "scripts" / "setup.sh").read_text())
    return version


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore's rule: the last pattern matching the path or one of its parents wins."""
    parts = Path(path).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        matches = any(fnmatch.fnmatch(c, pattern) or (pattern.startswith("**/") and
                      fnmatch.fnmatch(Path(c).name, pattern[3:])) for c in candidates)
        if matches:
            verdict = not negate
    return verdict


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_there_is_a_cpu_and_a_cuda_image() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_stages_pin_their_bases_and_the_last_runs_as_non_root(path: Path) -> None:
    dockerfile = parse(path)
    assert len(dockerfile.stages) >= 2, "multi-stage: build tools and caches stay out of the final image"
    names = {stage.name for stage in dockerfile.stages}
    for stage in dockerfile.stages:
        if stage.image in names:
            continue
        repository, _, tag = stage.image.rpartition("/")[2].partition(":")
        assert "@sha256:" in stage.image or re.search(r"\d+\.\d+\.\d+", tag), f"{stage.image}: pin a patch release"
        assert tag != "latest"
    final = dockerfile.stages[-1]
    users = final.all("USER")
    assert users, "the final stage must name its user"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and (not user.isdigit() or int(user) >= 1000), users[-1]
    assert not dockerfile.text_of("HEALTHCHECK"), "probes belong to Kubernetes (GET /health, GET /ready)"
    assert final.all("ENTRYPOINT") == ['["pdserve"]']
    labels = " ".join(final.all("LABEL"))
    for label in OCI_LABELS:
        assert f"org.opencontainers.image.{label}=" in labels, label


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_torch_is_the_version_setup_installs(path: Path) -> None:
    build_args = {name: default for stage in parse(path).stages
                  for name, _, default in (rest.partition("=") for rest in stage.all("ARG"))}
    assert build_args["TORCH_VERSION"] == setup_torch_version()
    runs = parse(path).text_of("RUN")
    assert '"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in runs
    assert runs.index("torch==") < runs.index("pip install ."), "torch first, so pdserve's range pulls no other"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_sources_are_in_the_build_context(path: Path) -> None:
    patterns = dockerignore()
    for stage in parse(path).stages:
        for rest in stage.all("COPY"):
            if "--from=" in rest:
                continue
            *sources, _ = [w for w in rest.split() if not w.startswith("--")]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such path"
                assert not ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    assert ignored(".venv/bin/python", patterns) and ignored(".git/HEAD", patterns)
    assert ignored("pdserve/__pycache__/cli.cpython-311.pyc", patterns)
    assert not ignored("pdserve/cli.py", patterns)


def test_cpu_image_bakes_a_demo_model_the_runtime_user_can_read() -> None:
    (path,) = [p for p in DOCKERFILES if p.name == "Dockerfile.cpu"]
    runs = parse(path).text_of("RUN")
    model = re.search(r"pdserve make-model (\S+)", runs)
    assert model, "the cpu overlay runs the demo model baked into the image"
    # make-model writes the weights 0600 as the build's root user; the runtime user is another
    assert re.search(r"chmod -R a\+rX (\S+)", runs) and model.group(1).startswith("/opt/pdserve")
    kustomization = (ROOT / "deploy" / "k8s" / "base" / "kustomization.yaml").read_text()
    assert f"PDSERVE_MODEL={model.group(1)}" in kustomization


def test_cuda_image_has_nixl_without_its_deps_and_the_ucx_modules() -> None:
    (path,) = [p for p in DOCKERFILES if p.name == "Dockerfile.cuda"]
    dockerfile = parse(path)
    assert dockerfile.stages[0].image.startswith("nvidia/cuda:12.")
    runs = dockerfile.text_of("RUN")
    assert 'pip install --no-deps "nixl-cu12==${NIXL_VERSION}"' in runs
    assert "ibverbs-providers" in runs, "the eRDMA/mlx5 verbs providers UCX's RDMA transport loads"
    assert "UCX_MODULE_DIR=/opt/venv/ucx-modules" in dockerfile.text_of("ENV")
