"""Single-file artifacts (`.spx`) and their atomic installation on a device (docs/artifact.md).

pack     a plain tar: manifest.json first, then manifest.sig when present, then every file the
         manifest lists (sorted); nothing else from the folder (no stray files travel).
unpack   into a versions folder next to the target and switch a symlink:

    DIR                 -> DIR.versions/<version>     (a symlink, replaced with os.replace: atomic)
    DIR.versions/<version>/...                       every installed version, newest `keep` + 1 kept

         Members are checked before anything is written: regular files only (no links, devices,
         FIFOs), relative paths inside the artifact (paths.confined rules), each at most once,
         the manifest first. They are extracted into a temporary folder inside DIR.versions, whose
         manifest (schema, paths), signature (when trusted keys are given) and checksums are then
         verified; only then is the folder renamed to its version name and the symlink switched.
         A crash at any point leaves DIR pointing at the previous complete version (or absent
         on a first install): never at a mix. A temporary folder left by a crash is removed by
         the next unpack. A package that ends early or whose files do not match its manifest (a
         failed download) is a PackageError saying to download it again; a failed first install
         leaves no DIR.versions behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from .errors import ArtifactError, InvalidArgument
from .manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, read_manifest, sha256_file, verify_files
from .paths import confined

SUFFIX = ".spx"
TMP_PREFIX = ".unpack-"


class PackageError(ArtifactError):
    """A package is malformed or holds a member that could escape the artifact."""


def pack(root: Path, out: Path) -> Path:
    """Write `out` (a .spx tar) from the artifact folder `root` (checksums verified first)."""
    root, out = Path(root), Path(out)
    manifest = read_manifest(root)
    verify_files(root, manifest)
    names = [MANIFEST_NAME] + ([SIGNATURE_NAME] if (root / SIGNATURE_NAME).is_file() else []) + sorted(manifest.files)
    tmp = out.with_name(f".{out.name}.tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            info = tar.gettarinfo(str(root / name), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o644
            with open(root / name, "rb") as handle:
                tar.addfile(info, handle)
    os.replace(tmp, out)
    return out


def _check_member(member: tarfile.TarInfo, seen: set[str]) -> str:
    name = member.name
    if not member.isreg():
        raise PackageError(
            f"package member {name!r} is not a regular file ({member.type!r}): links and devices are refused"
        )
    if name in seen:
        raise PackageError(f"package member {name!r} appears twice")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name or not name:
        raise PackageError(f"package member {name!r} would land outside the artifact")
    seen.add(name)
    return name


def peek_manifest(package: Path) -> Manifest:
    """The manifest of a .spx package, read from its first member without unpacking or verifying
    anything: for settings that must be known before the package is installed (serve's
    max_batch on a cluster); whatever runs the artifact still unpacks and verifies it."""
    try:
        with tarfile.open(package, "r:") as tar:
            first = tar.next()
            if first is None or first.name != MANIFEST_NAME or not first.isreg():
                raise PackageError(f"{str(package)!r} does not start with {MANIFEST_NAME}: it is not a .spx package")
            data = tar.extractfile(first).read()
    except (OSError, tarfile.TarError) as exc:
        raise PackageError(f"{str(package)!r} is not a readable .spx (tar) package: {exc}") from None
    try:
        return Manifest.from_dict(json.loads(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackageError(f"the {MANIFEST_NAME} of {str(package)!r} is not valid JSON: {exc}") from None


def _versions(target: Path) -> Path:
    return target.with_name(target.name + ".versions")


def unpack(
    package: Path, target: Path, trusted_keys: Sequence[str | Path | bytes] | None = None, keep: int = 1
) -> Path:
    """Install `package` at `target` (module docstring); returns the new version's folder."""
    package, target = Path(package), Path(target)
    if keep < 0:
        raise InvalidArgument(f"keep must be >= 0, got {keep}")
    if target.exists() and not target.is_symlink():
        raise InvalidArgument(
            f"{str(target)!r} is a plain folder; unpack installs at a path it manages "
            f"(a symlink into {_versions(target).name}/): choose a new path"
        )
    versions = _versions(target)
    first_install = not versions.exists()
    versions.mkdir(parents=True, exist_ok=True)
    for stale in versions.glob(TMP_PREFIX + "*"):  # a crashed earlier unpack: a folder, or its switch's link
        if stale.is_symlink():
            stale.unlink(missing_ok=True)
        else:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = versions / f"{TMP_PREFIX}{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        try:
            tar = tarfile.open(package, "r:")
        except (OSError, tarfile.TarError) as exc:
            raise PackageError(
                f"{str(package)!r} is not a readable .spx (tar) package ({exc}):"
                " if it was downloaded, download it again"
            ) from None
        seen: set[str] = set()
        try:
            _extract(tar, tmp, seen)
        except (tarfile.TarError, EOFError) as exc:  # the tar ends early or is garbled: a failed download
            raise PackageError(f"{str(package)!r} is incomplete or damaged ({exc}): download it again") from None
        if trusted_keys is not None:
            from .signing import verify as verify_signature

            verify_signature(tmp, trusted_keys)
        manifest = _verify_download(package, tmp)
        unlisted = seen - set(manifest.files) - {MANIFEST_NAME, SIGNATURE_NAME}
        if unlisted:
            raise PackageError(f"package member {sorted(unlisted)[0]!r} is not listed in its manifest")
        version = versions / f"{manifest.name}-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**9:09d}"
        os.rename(tmp, version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if first_install:  # leave nothing behind
            shutil.rmtree(versions, ignore_errors=True)
        raise
    _switch(target, version)
    for old in _older_versions(versions, version)[keep:]:  # keep the current one and `keep` before it
        shutil.rmtree(old, ignore_errors=True)
    return version


def _verify_download(package: Path, tmp: Path) -> Manifest:
    """The extracted package's manifest after every listed file was checked; a file missing (the tar
    ended at a member boundary) or differing from its checksum is a PackageError: download again."""
    try:
        manifest = read_manifest(tmp)
    except ArtifactError as exc:
        raise PackageError(f"{str(package)!r} holds no valid manifest ({exc}): download it again") from None
    for rel, expected in sorted(manifest.files.items()):
        path = confined(tmp, rel, "manifest files entry")
        if not path.is_file():
            raise PackageError(f"{str(package)!r} ends before {rel!r} (an incomplete download): download it again")
        if sha256_file(path) != expected:
            raise PackageError(
                f"{str(package)!r}: {rel!r} differs from its manifest checksum (a damaged download): download it again"
            )
    return manifest


def _extract(tar: tarfile.TarFile, tmp: Path, seen: set[str]) -> None:
    """Every member of `tar` into `tmp`, each checked first (_check_member); names into `seen`."""
    with tar:
        for i, member in enumerate(tar):
            name = _check_member(member, seen)
            if i == 0 and name != MANIFEST_NAME:
                raise PackageError(f"the package's first member is {name!r}; a .spx starts with {MANIFEST_NAME}")
            dest = confined(tmp, name, "package member")
            dest.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            with open(dest, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())


def _switch(target: Path, version: Path) -> None:
    """Point the symlink `target` at `version`: a new link renamed over the old one (atomic on POSIX)."""
    link = _versions(target) / f"{TMP_PREFIX}link-{os.getpid()}"
    os.symlink(os.path.relpath(version, target.parent), link)
    os.replace(link, target)


def _older_versions(versions: Path, current: Path) -> list[Path]:
    """Complete installed versions other than `current`, newest first."""
    current = current.resolve()
    return sorted(
        (p for p in versions.iterdir() if p.is_dir() and not p.name.startswith(TMP_PREFIX) and p.resolve() != current),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )


def rollback(target: Path) -> Path:
    """Point `target` back at the newest version before the current one."""
    target = Path(target)
    if not target.is_symlink():
        raise InvalidArgument(f"{str(target)!r} was not installed by unpack (not a symlink)")
    older = _older_versions(_versions(target), target)
    if not older:
        raise InvalidArgument(f"no earlier version of {str(target)!r} is kept in {_versions(target).name}/")
    _switch(target, older[0])
    return older[0]


__all__ = ["SUFFIX", "PackageError", "pack", "rollback", "unpack"]
