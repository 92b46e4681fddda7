"""Mount checks and env.sh: errors name the key; env.sh, sourced by real bash, yields the values."""
from __future__ import annotations

import pytest

from bundle_helpers import bash
from rlc.compiler.bundle import BundleError
from rlc.compiler.bundle.env import env_lines
from rlc.compiler.bundle.mounts import BUNDLE_MOUNT, check_mounts, parse_mount

RESERVED = {BUNDLE_MOUNT: "the bundle", "/logs": "cluster.log_dir"}


def test_parse_mount_forms():
    assert parse_mount("/a:/b", "k").spec == "/a:/b"
    assert parse_mount("/a/:/b/./c:ro", "k").spec == "/a:/b/c:ro"
    assert parse_mount("/a:/b:rw", "k").mode == "rw"


@pytest.mark.parametrize("entry,message", [
    ("/a", "is not `src:dst`"),
    ("/a:/b:ro:x", "is not `src:dst`"),
    ("/a:/b:rbind", "mount option 'rbind' is not supported"),
    ("a:/b", "source mount path 'a' is not absolute"),
    ("/a:b", "destination mount path 'b' is not absolute"),
    ("/a,b:/c", "'/a,b:/c' contains ','; write one mount per list entry"),
    ("/a:/c d", "destination mount path '/c d' contains the character ' '"),
    ("/a:/", "mounting over / would break"),
    ("/a:/proc", "mounting over /proc"),
    ("/a:/sys/fs/x", "mounting over /sys/fs/x"),
    ("/a:/dev", "mounting over /dev"),
    ("/a:/opt/rlc-bundle/rlc_pkg", "is where the bundle mounts the bundle"),
    ("/a:/logs", "is where the bundle mounts cluster.log_dir"),
])
def test_bad_mounts_are_rejected_naming_the_entry(entry, message):
    with pytest.raises(BundleError) as err:
        check_mounts(["/ok:/ok", entry], [], RESERVED)
    assert str(err.value).startswith("cluster.container.mounts[1]: ")
    assert message in str(err.value)
    assert err.value.key == "cluster.container.mounts[1]" and err.value.exit_code == 1


def test_duplicate_destination_names_both_entries():
    with pytest.raises(BundleError, match=r"mounts\[1\]: destination /d is already mounted by "
                                          r"cluster.container.mounts\[0\]"):
        check_mounts(["/a:/d", "/b:/d/"], [], RESERVED)


def test_source_outside_shared_roots_warns_only():
    mounts, warnings = check_mounts(["/lustre/x:/x", "/scratch/y:/y:ro"], ["/lustre", "/home"], RESERVED)
    assert [m.spec for m in mounts] == ["/lustre/x:/x", "/scratch/y:/y:ro"]
    assert len(warnings) == 1 and "mounts[1]: source /scratch/y is outside cluster.shared_fs_roots" in warnings[0]
    assert check_mounts(["/scratch/y:/y"], [], RESERVED)[1] == []  # no roots given: nothing to compare


def _source_env(lines, extra=":"):
    text = "\n".join(lines) + "\n"
    return bash(f"export RLC_BUNDLE_MNT=/B RLC_JOB_DIR=/J; {extra}; eval \"$1\"; env -0", text)


def test_env_sh_values_round_trip_through_bash():
    weird = {"A": "x y", "B": "it's \"q\" $(touch /tmp/rlc-never) `id`; rm -rf /", "C": "line1\nline2",
             "D": 3, "E": True, "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    out = _source_env(env_lines(weird))
    assert out.returncode == 0, out.stderr
    env = dict(kv.split("=", 1) for kv in out.stdout.split("\0") if "=" in kv)
    assert env["A"] == "x y" and env["B"] == weird["B"] and env["C"] == "line1\nline2"
    assert env["D"] == "3" and env["E"] == "1"
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == "/J/ray-auth/token"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_pythonpath_puts_the_bundle_first_then_recipe_then_container():
    out = _source_env(env_lines({"PYTHONPATH": "/my code"}), extra="export PYTHONPATH=/container")
    env = dict(kv.split("=", 1) for kv in out.stdout.split("\0") if "=" in kv)
    assert env["PYTHONPATH"] == "/B/rlc_pkg:/my code:/container"
    out = _source_env(env_lines({}), extra="unset PYTHONPATH")
    env = dict(kv.split("=", 1) for kv in out.stdout.split("\0") if "=" in kv)
    assert env["PYTHONPATH"] == "/B/rlc_pkg"


def test_recipe_may_override_bundle_defaults():
    out = _source_env(env_lines({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}))
    env = dict(kv.split("=", 1) for kv in out.stdout.split("\0") if "=" in kv)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


@pytest.mark.parametrize("name", ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS",
                                  "RLC_JOB_DIR", "SLURM_CPUS_PER_TASK", "RAY_AUTH_SOMETHING"])
def test_bundle_owned_env_names_are_rejected(name):
    with pytest.raises(BundleError, match=rf"^cluster\.env\.{name}: {name} cannot be set in a recipe"):
        env_lines({name: "disabled"})


def test_nul_in_env_value_is_rejected():
    with pytest.raises(BundleError, match=r"cluster\.env\.X: the value contains a NUL byte"):
        env_lines({"X": "a\x00b"})


def test_references_to_other_variables_are_expanded_at_job_start_and_nothing_else():
    env_in = {"PATH": "/opt/conda/bin:$PATH", "HOME_LOGS": "${HOME}/logs", "PRICE": "$$5 and $(id) `id` $",
              "UNSET": "a${RLC_TEST_SURELY_UNSET}b", "MIXED": "'$HOME'\"x\""}
    out = _source_env(env_lines(env_in), extra="export PATH=/usr/bin:/bin HOME=/home/u")
    assert out.returncode == 0, out.stderr
    env = dict(kv.split("=", 1) for kv in out.stdout.split("\0") if "=" in kv)
    assert env["PATH"] == "/opt/conda/bin:/usr/bin:/bin"
    assert env["HOME_LOGS"] == "/home/u/logs"
    assert env["PRICE"] == "$5 and $(id) `id` $"
    assert env["UNSET"] == "ab"
    assert env["MIXED"] == "'/home/u'\"x\""
