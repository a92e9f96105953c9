"""The GPU kit's plumbing, here without a GPU: its calls fit the device time, and its parts,
cut into one piece per call, are unpacked as their bytes arrive (scripts/device_kit.sh's pack,
scripts/kit_unpack.py). The steps themselves are rehearsed by scripts/gpu_rehearse.sh."""

import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "gpu_check.sh"


def test_the_kits_calls_fit_one_call_each_and_the_device_time():
    """Summed here from the script's own table (each step's limit, the calls' step lists, the
    start and per-call allowances), against the device's 600 s a call and the kit's 720 s."""
    text = CHECK.read_text()
    table = re.search(r"declare -A LIMIT=\((.*?)\n\)", text, re.S).group(1)
    limit = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", table)}
    calls = {int(n): steps.split() for n, steps in re.findall(r'^CALL(\d)="([^"]*)"', text, re.M)}
    start = int(re.search(r"^START_S=(\d+)", text, re.M).group(1))
    per_call = int(re.search(r"^CALL_S=(\d+)", text, re.M).group(1))
    assert sorted(calls) == [1, 2, 3] and calls[2][-1] == "mjlab_lift"  # the first in value
    seconds = {n: per_call + sum(limit[s] for s in steps) for n, steps in calls.items()}
    assert all(s <= 600 for s in seconds.values()), seconds
    assert start + sum(seconds.values()) <= 12 * 60

    out = subprocess.run(["bash", str(CHECK), "--budget"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    for n, s in seconds.items():
        assert f"call{n}: {s}s" in out.stdout
    assert f"total: {start + sum(seconds.values())}s of 720s" in out.stdout


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=0) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _dist(name: str, version: str) -> dict[str, bytes]:
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    return {f"{name}-{version}.dist-info/METADATA": meta}


def test_parts_are_unpacked_once_all_their_pieces_have_arrived(tmp_path):
    """Four parts of ~0.6-1.5 MiB of random bytes (incompressible), packed by device_kit.sh in
    pieces of 1 MiB; the pieces arrive one per call and each call unpacks what is complete.
    Ray's dependencies: one this Python has (pytest) is kept, one it lacks is copied."""
    kit = tmp_path / "kit"
    kit.mkdir()
    rnd = lambda n: os.urandom(n)  # noqa: E731
    contents = {
        "core": {"site/core_mod/__init__.py": b"x = 1\n", "site/core_mod/blob": rnd(600_000)},
        "mjlab": {"site/mjlab_mod/blob": rnd(1_500_000)},
        "ray": {"site/ray_mod/raylet": rnd(700_000),
                **{f"deps/pytest/{k}": v for k, v in _dist("pytest", "0.0.1").items()},
                **{f"deps/nosuchdep/{k}": v for k, v in _dist("nosuchdep", "1.0").items()},
                "deps/nosuchdep/nosuchdep.py": b"here = True\n",
                "deps/pytest/pytest_shadow.py": b"never = True\n"},
        "maniskill": {"site/ms_mod/blob": rnd(900_000)},
    }
    for name, files in contents.items():
        (kit / f"{name}.tar.xz").write_bytes(_tar_xz(files))
    env = {**os.environ, "KIT": str(kit), "LOAD": "1"}
    pack = subprocess.run(["bash", str(ROOT / "scripts" / "device_kit.sh"), "pack"], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    assert pack.returncode == 0, pack.stdout + pack.stderr
    pieces = sorted(kit.glob("kit.*"), key=lambda p: int(p.suffix[1:]))
    sizes = {n: (kit / f"{n}.tar.xz").stat().st_size for n in contents}
    assert len(pieces) == -(-sum(sizes.values()) // 2**20) >= 4
    assert b"".join(p.read_bytes() for p in pieces) == b"".join(
        (kit / f"{n}.tar.xz").read_bytes() for n in ("core", "mjlab", "ray", "maniskill"))

    here, site = tmp_path / "pieces", tmp_path / "site"
    here.mkdir()
    (here / "parts.tsv").write_bytes((kit / "parts.tsv").read_bytes())
    ends, offset = {}, 0
    for n in ("core", "mjlab", "ray", "maniskill"):
        offset += sizes[n]
        ends[n] = offset
    for i, piece in enumerate(pieces):
        (here / piece.name).write_bytes(piece.read_bytes())
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kit_unpack.py"), str(here),
                              str(site)], capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
        arrived = (i + 1) * 2**20
        for n, end in ends.items():
            complete = end <= arrived
            assert (here / f"{n}.done").exists() == complete, (i, n, run.stdout)
    assert (site / "core_mod" / "__init__.py").read_bytes() == b"x = 1\n"
    for n, path in (("core", "core_mod/blob"), ("mjlab", "mjlab_mod/blob"),
                    ("ray", "ray_mod/raylet"), ("maniskill", "ms_mod/blob")):
        assert (site / path).read_bytes() == contents[n]["site/" + path], n
    assert os.access(site / "ray_mod" / "raylet", os.X_OK)  # modes kept (Ray's daemons)
    assert (site / "nosuchdep.py").is_file() and not (site / "pytest_shadow.py").exists()


def test_a_piece_from_another_kit_is_refused(tmp_path):
    kit = tmp_path / "kit"
    kit.mkdir()
    for name in ("core", "mjlab", "ray", "maniskill"):
        (kit / f"{name}.tar.xz").write_bytes(_tar_xz({f"site/{name}.txt": name.encode()}))
    env = {**os.environ, "KIT": str(kit), "LOAD": "1"}
    subprocess.run(["bash", str(ROOT / "scripts" / "device_kit.sh"), "pack"], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    data = bytearray((kit / "kit.0").read_bytes())
    data[100] ^= 0xFF
    (kit / "kit.0").write_bytes(bytes(data))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kit_unpack.py"), str(kit),
                          str(tmp_path / "site")], capture_output=True, text=True)
    assert run.returncode == 1 and "core: checksum does not match" in run.stdout
