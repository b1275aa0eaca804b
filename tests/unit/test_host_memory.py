"""The host memory a server may use, cgroup limits included (gpu_server/backends/host_memory.py), read
from file trees laid out as a host's are."""
from phos.gpu_server.backends import host_memory


def tree(tmp_path, files):
    for path, text in files.items():
        f = tmp_path / path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_a_v2_cgroups_tightest_limit_and_its_ancestors(tmp_path):
    tree(tmp_path, {"proc": "0::/a/b\n", "cg/cgroup.controllers": "memory\n", "cg/a/memory.max": "3221225472\n",
                    "cg/a/b/memory.max": "max\n"})
    assert host_memory.cgroup_limit(str(tmp_path / "proc"), str(tmp_path / "cg")) == 3 << 30


def test_a_v1_memory_cgroup_and_a_containers_own_root(tmp_path):
    tree(tmp_path, {"proc": "4:memory:/x/y\n1:cpu:/\n0::/\n", "cg/memory/x/y/memory.limit_in_bytes": str(2 << 30)})
    assert host_memory.cgroup_limit(str(tmp_path / "proc"), str(tmp_path / "cg")) == 2 << 30
    # a container sees its cgroup as the mount's root: the path is not there
    tree(tmp_path, {"proc2": "4:memory:/process_api/abc\n",
                    "cg2/memory/memory.limit_in_bytes": str(1 << 30)})
    assert host_memory.cgroup_limit(str(tmp_path / "proc2"), str(tmp_path / "cg2")) == 1 << 30


def test_no_limit(tmp_path):
    tree(tmp_path, {"proc": "4:memory:/\n", "cg/memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert host_memory.cgroup_limit(str(tmp_path / "proc"), str(tmp_path / "cg")) is None
