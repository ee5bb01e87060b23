"""autopar.mesh: offline meshes, CLI parsing, defaults, errors, JSON round trip."""

from __future__ import annotations

import json
import pickle

import pytest

from autopar.mesh import Mesh
from cost_models import LinkSpec, Profile, get_device, get_link, save_profile


def test_2d_mesh_defaults_dp_tp_with_infiniband_outside_nvlink_inside() -> None:
    mesh = Mesh.spec((8, 8))
    assert mesh.axis_names == ("dp", "tp")
    assert mesh.device == get_device("h100")
    assert [link.name for link in mesh.links] == ["infiniband", "nvlink"]
    assert mesh.num_devices == 64 and mesh.ndim == 2
    assert mesh.describe() == "dp=8 (infiniband) x tp=8 (nvlink) on h100"


def test_1d_and_3d_meshes_are_named_a0_a1() -> None:
    one = Mesh.spec(8)
    assert one.shape == (8,) and one.axis_names == ("a0",)
    assert [link.name for link in one.links] == ["nvlink"]
    three = Mesh.spec((2, 2, 4))
    assert three.axis_names == ("a0", "a1", "a2")
    assert [link.name for link in three.links] == ["infiniband", "infiniband", "nvlink"]
    assert three.num_devices == 16
    four = Mesh.spec((2, 2, 2, 2), ("pp", "dp", "cp", "tp"))
    assert four.axis_size("cp") == 2 and four.ndim == 4


def test_cpu_mesh_uses_loopback_and_a100_uses_nvlink3() -> None:
    cpu = Mesh.spec((2, 2), device="cpu")
    assert [link.name for link in cpu.links] == ["loopback", "loopback"]
    a100 = Mesh.spec((4, 8), device="a100")
    assert [link.name for link in a100.links] == ["infiniband", "nvlink3"]


def test_links_override_by_sequence_or_mapping() -> None:
    custom = LinkSpec(name="roce", bandwidth_Bps=25e9, latency_s=8e-6)
    by_seq = Mesh.spec((2, 4), links=["ethernet", custom])
    assert by_seq.links == (get_link("ethernet"), custom)
    by_name = Mesh.spec((2, 4), ("dp", "tp"), links={"dp": "ethernet"})
    assert by_name.links == (get_link("ethernet"), get_link("nvlink"))
    by_index = Mesh.spec((2, 2, 2), links={2: "loopback", "0": custom})
    assert by_index.links == (custom, get_link("infiniband"), get_link("loopback"))


def test_profile_overrides_device_and_links(tmp_path) -> None:
    prof = {
        "version": 1,
        "device": {"name": "h100-calibrated", "base": "h100", "op_efficiency": {"matmul": 0.8}},
        "links": {"tp": {"base": "nvlink", "bandwidth_Bps": 3.7e11}, "0": {"base": "ethernet"}},
    }
    mesh = Mesh.spec((2, 8), device="h100", profile=prof)
    assert mesh.device.name == "h100-calibrated" and mesh.device.op_efficiency["matmul"] == 0.8
    assert mesh.links[1].bandwidth_Bps == 3.7e11
    assert mesh.links[0].name == "ethernet"
    path = tmp_path / "p.json"
    save_profile(Profile(links={"a1": get_link("ethernet")}), path)
    from_file = Mesh.spec((2, 2, 2), profile=path)
    assert from_file.links[1].name == "ethernet" and from_file.device.name == "h100"
    with pytest.raises(ValueError, match="profile links key 'pp' is not an axis"):
        Mesh.spec((2, 2), profile=Profile(links={"pp": get_link("nvlink")}))


@pytest.mark.parametrize(
    ("text", "shape", "names"),
    [
        ("8", (8,), ("a0",)),
        ("8x8", (8, 8), ("dp", "tp")),
        ("2x2x2", (2, 2, 2), ("a0", "a1", "a2")),
        ("dp=8,tp=8", (8, 8), ("dp", "tp")),
        (" dp=2, tp=4 ", (2, 4), ("dp", "tp")),
        ("pp=2,dp=2,tp=2", (2, 2, 2), ("pp", "dp", "tp")),
        ("4X2", (4, 2), ("dp", "tp")),
    ],
)
def test_parse_cli_text(text: str, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    mesh = Mesh.parse(text, device="cpu")
    assert mesh.shape == shape and mesh.axis_names == names
    assert mesh.device.name == "cpu"


@pytest.mark.parametrize("text", ["", "8x", "axb", "dp=8,8", "dp=8,tp", "8,8", "dp=x"])
def test_parse_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ValueError, match="cannot read mesh"):
        Mesh.parse(text)


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="mesh axis 1 has size 0"):
        Mesh.spec((2, 0))
    with pytest.raises(ValueError, match="mesh axis 0 has size -2"):
        Mesh.parse("-2x4")
    with pytest.raises(ValueError, match="2 axes but 3 names"):
        Mesh.spec((2, 2), ("a", "b", "c"))
    with pytest.raises(ValueError, match="duplicate mesh axis names"):
        Mesh.spec((2, 2), ("dp", "dp"))
    with pytest.raises(ValueError, match="duplicate mesh axis names"):
        Mesh.parse("dp=2,dp=4")
    with pytest.raises(ValueError, match="unknown device 'h300'.*h200"):
        Mesh.spec((2, 2), device="h300")
    with pytest.raises(ValueError, match="unknown link 'token-ring'.*infiniband"):
        Mesh.spec((2, 2), links={"tp": "token-ring"})
    with pytest.raises(ValueError, match="one entry per axis"):
        Mesh.spec((2, 2), links=["nvlink"])
    with pytest.raises(ValueError, match="links= key 'sp' is not an axis"):
        Mesh.spec((2, 2), links={"sp": "nvlink"})
    with pytest.raises(ValueError, match="at least one axis"):
        Mesh.spec(())


def test_axis_index_by_name_or_index() -> None:
    mesh = Mesh.spec((2, 4, 8), ("dp", "cp", "tp"))
    assert mesh.axis_index("tp") == 2 and mesh.axis_index(1) == 1 and mesh.axis_index(-1) == 2
    assert mesh.axis_size("cp") == 4 and mesh.link("tp").name == "nvlink"
    with pytest.raises(ValueError, match="no axis named 'pp'.*'dp', 'cp', 'tp'"):
        mesh.axis_index("pp")
    with pytest.raises(ValueError, match="out of range"):
        mesh.axis_index(3)


def test_to_dict_round_trip_is_lossless_and_json_friendly() -> None:
    custom = LinkSpec(
        name="ib-cal",
        bandwidth_Bps=4.6e10,
        latency_s=6e-6,
        collectives={"all_reduce": (5e-6, 2.2e-11)},
    )
    for mesh in (
        Mesh.spec((8, 8)),
        Mesh.spec(4, device="cpu"),
        Mesh.spec((2, 2, 2), ("x", "y", "z"), device="a100-40gb", links={"x": custom}),
    ):
        again = Mesh.from_dict(json.loads(json.dumps(mesh.to_dict())))
        assert again == mesh and hash(again) == hash(mesh)
        assert pickle.loads(pickle.dumps(mesh)) == mesh
    with pytest.raises(ValueError, match="misses"):
        Mesh.from_dict({"shape": [2]})


def test_mesh_is_frozen() -> None:
    mesh = Mesh.spec((2, 2))
    with pytest.raises(AttributeError):
        mesh.shape = (4,)  # type: ignore[misc]
