"""Unpacks the GPU kit's parts (scripts/device_kit.sh) as their bytes arrive, call by call.

The parts are one stream cut into pieces (``kit.0``, ``kit.1``, ...), one per device call;
``parts.tsv`` says where each part lies in the stream and its sha256. Each call copies the
pieces it carries into PIECES (kept between calls while the machine stays warm); this script
then unpacks every part whose bytes are all there and that is not unpacked yet: ``core``,
``mjlab`` and ``maniskill`` into SITE (their archives hold ``site/``), ``ray`` with its own
dependencies copied only where this Python lacks them (a copy of one it has would shadow it for
torch and transformers too). One line per part unpacked or still waiting.

    python scripts/kit_unpack.py PIECES SITE
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import io
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path


def read_parts(pieces: Path) -> tuple[int, list[tuple[str, int, int, str]]]:
    lines = (pieces / "parts.tsv").read_text().split("\n")
    piece_bytes = int(lines[0].split("\t")[1])
    parts = [(n, int(o), int(s), h) for n, o, s, h in (ln.split("\t") for ln in lines[1:] if ln)]
    return piece_bytes, parts


def part_bytes(pieces: Path, piece_bytes: int, offset: int, size: int) -> bytes | None:
    """The part's bytes from the pieces here, or None while one of its pieces is missing."""
    out = bytearray()
    for i in range(offset // piece_bytes, (offset + size - 1) // piece_bytes + 1):
        f = pieces / f"kit.{i}"
        if not f.is_file():
            return None
        data = f.read_bytes()
        lo = max(offset - i * piece_bytes, 0)
        hi = min(offset + size - i * piece_bytes, len(data))
        out += data[lo:hi]
    return bytes(out)


def under_site(tar: tarfile.TarFile):
    """The archive's members below its top folder ``site/``, named relative to it."""
    for m in tar.getmembers():
        if m.name.startswith("site/"):
            m.name = m.name[len("site/"):]
            yield m


def install_ray(tar: tarfile.TarFile, site: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tar.extractall(tmp, filter="tar")
        shutil.copytree(Path(tmp) / "site", site, dirs_exist_ok=True)
        for d in sorted((Path(tmp) / "deps").iterdir()):
            dist = md.Distribution.at(next(d.glob("*.dist-info")))
            name = dist.metadata["Name"]
            try:
                print(f"ray dependency {name}: {md.version(name)} installed, kept")
            except md.PackageNotFoundError:
                shutil.copytree(d, site, dirs_exist_ok=True)
                print(f"ray dependency {name}: {dist.version} from the kit")


def main(pieces: Path, site: Path) -> int:
    piece_bytes, parts = read_parts(pieces)
    site.mkdir(parents=True, exist_ok=True)
    for name, offset, size, sha in parts:
        done = pieces / f"{name}.done"
        if done.exists():
            continue
        data = part_bytes(pieces, piece_bytes, offset, size)
        if data is None:
            print(f"kit: {name} waiting for its other pieces")
            continue
        if hashlib.sha256(data).hexdigest() != sha:
            print(f"kit: {name}: checksum does not match parts.tsv (a piece from another kit?)")
            return 1
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
            if name == "ray":
                install_ray(tar, site)
            else:
                tar.extractall(site, members=under_site(tar), filter="tar")
        done.touch()
        print(f"kit: {name} unpacked into {site} ({size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
