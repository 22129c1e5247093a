"""The device plugin configuration for stages sharing GPUs through MPS (docs/gpu.md): the shape
the NVIDIA device plugin reads (version v1, sharing.mps over nvidia.com/gpu), the shares the docs
describe, and the overlay leaving it out of its resources (it configures the cluster's plugin)."""

from __future__ import annotations

import yaml

from tests.k8s.manifests import K8S


def test_the_mps_configuration_shares_each_gpu_between_two_stage_pods():
    config = yaml.safe_load((K8S / "overlays/gpu/device-plugin-mps.yaml").read_text())
    assert config["version"] == "v1" and set(config["sharing"]) == {"mps"}
    (resource,) = config["sharing"]["mps"]["resources"]
    assert resource == {"name": "nvidia.com/gpu", "replicas": 2}  # the stage pods ask for nvidia.com/gpu: 1
    overlay = yaml.safe_load((K8S / "overlays/gpu/kustomization.yaml").read_text())
    assert "device-plugin-mps.yaml" not in overlay["resources"]
