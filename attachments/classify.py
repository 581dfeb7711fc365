"""What kind of attachment a file is: text, image or PDF, or refused.

Chat takes three kinds (docs/DESIGN.md, "Attachments"); anything else is refused
with "<name>: chat supports text, images and PDF".  The decision
looks at the file's name and its first ``HEAD_BYTES`` bytes, in this order:

1. A ``.pdf`` suffix is a PDF; so is any file whose first KiB holds ``%PDF-``
   (a PDF saved without its suffix).
2. A code, config or markup suffix (``TEXT_SUFFIXES``), or a well-known name
   without a suffix (``TEXT_NAMES``: Makefile, Dockerfile, .bashrc ...), is text.
   The suffix wins over the content, so a ``.ts`` file is TypeScript and not the
   MPEG stream ``mimetypes`` would call it.
3. A PNG, JPEG, WebP or GIF suffix, or the magic number of one, is an image.
   Pillow later checks the real format (``images.py``): a ``.png`` that is in
   fact a BMP is refused there.
4. A ``text/*`` type from ``mimetypes`` (or a textual application type such as
   JSON or XML) is text.
5. Otherwise, a file whose first 8 KiB are valid UTF-8 with no NUL byte counts
   as text.  A user expects ``notes``, ``foo.txt.bak`` or ``build.log.1`` to
   work, and binary formats fail this test almost at once (they hold NULs or
   invalid UTF-8 sequences early).  A multi-byte character cut at the 8 KiB
   boundary does not count against the file.
6. Anything else is refused (``UnsupportedKind``).
"""

from __future__ import annotations

import codecs
import mimetypes
import os
from dataclasses import dataclass
from typing import Literal

from core.errors import UnsupportedKind

__all__ = [
    "IMAGE_SUFFIXES",
    "Kind",
    "TEXT_NAMES",
    "TEXT_SUFFIXES",
    "Classified",
    "classify",
    "is_code",
    "looks_like_text",
    "suffix_of",
    "unsupported",
]

# documents (docx ... html) are told and read by office.py, videos by video.py; classify() itself
# never returns them, so a caller that reads only text and PDFs (a knowledge base) keeps refusing them
Kind = Literal["text", "image", "pdf", "docx", "pptx", "xlsx", "odt", "ods", "epub", "html", "video"]

# Code, config, markup and data formats people paste into a chat; lower case, no dot.
TEXT_SUFFIXES = frozenset("""
    txt text md markdown mdx rst adoc asciidoc org tex latex bib sty cls ltx texi
    log out err csv tsv psv diff patch rej srt vtt sub ass ics vcf
    py pyi pyw pyx pxd ipynb js mjs cjs ts mts cts tsx jsx go rs c h cc cpp cxx hpp hh hxx
    ipp inl m mm cs fs fsi fsx vb java kt kts swift rb rake gemspec php phtml pl pm t pod
    lua r rmd jl scala sc sbt groovy gradle clj cljs cljc edn el lisp lsp scm ss rkt
    hs lhs ml mli elm erl hrl ex exs eex heex leex nim zig v sv svh vhd vhdl d dart
    asm s nasm f f77 f90 f95 f03 for pas pp ada adb ads cob cbl tcl awk sed bc
    sh bash zsh fish ksh csh tcsh ps1 psm1 psd1 bat cmd nu
    sql psql ddl dml prisma graphql gql proto thrift avsc capnp
    html htm xhtml shtml css scss sass less styl vue svelte astro hbs handlebars
    mustache jinja jinja2 j2 njk liquid twig erb ejs pug haml tpl tmpl
    json jsonl ndjson json5 jsonc geojson har yaml yml toml ini cfg conf cnf
    properties prefs env envrc editorconfig xml xsd xsl xslt dtd plist svg rss atom
    qml qrc ui glsl vert frag hlsl wgsl cu cuh cl metal
    nix dhall hcl tf tfvars nomad cue jsonnet libsonnet rego bzl bazel star
    cmake mk mak make makefile dockerfile containerfile justfile
    vim vimrc lock sum mod service socket timer target mount desktop rules
    gitignore gitattributes gitmodules dockerignore npmrc yarnrc babelrc eslintrc
    prettierrc stylelintrc browserslistrc nvmrc
    http rest po pot strings resx sln csproj vcxproj fsproj pbxproj xcconfig
    gd gdscript tscn tres godot hx sol move cairo purs res resi idr agda lean v coq
    pro pri qbs qmldir qss rc def manifest reg
""".split())

# File names that are text without a suffix (compared case-sensitively, then lower-cased).
TEXT_NAMES = frozenset("""
    Makefile makefile GNUmakefile Dockerfile Containerfile Vagrantfile Jenkinsfile
    Gemfile Rakefile Procfile Brewfile Pipfile Podfile Fastfile Justfile justfile
    Snakefile Tiltfile Earthfile Caddyfile PKGBUILD APKBUILD BUILD WORKSPACE
    README LICENSE LICENCE COPYING COPYRIGHT AUTHORS CONTRIBUTORS CHANGELOG CHANGES
    NEWS HISTORY INSTALL TODO NOTICE THANKS MAINTAINERS CODEOWNERS OWNERS VERSION
    .bashrc .bash_profile .bash_logout .bash_aliases .profile .zshrc .zshenv .zprofile
    .zlogin .kshrc .cshrc .tcshrc .inputrc .vimrc .gvimrc .exrc .nanorc .tmux.conf
    .screenrc .xinitrc .xprofile .xsession .Xresources .Xdefaults .gitconfig .gitignore
    .gitattributes .gitmodules .mailmap .hgignore .dockerignore .npmignore .npmrc
    .yarnrc .editorconfig .env .envrc .flake8 .pylintrc .coveragerc .clang-format
    .clang-tidy .prettierrc .eslintrc .babelrc .stylelintrc .luacheckrc .rgignore
    .ignore .curlrc .wgetrc .netrc .muttrc .gdbinit .Rprofile .condarc .pypirc
    crontab fstab hosts hostname passwd group shells environment sudoers
""".split())

# Text suffixes of prose and data rather than code (presets tell the two apart: core/presets.py)
PROSE_SUFFIXES = frozenset("""
    txt text md markdown mdx rst adoc asciidoc org tex latex bib texi log out err csv tsv psv
    srt vtt sub ass ics vcf po pot strings
""".split())
# Names without a suffix that are build files or scripts, not prose (README, LICENSE ... are prose)
CODE_NAMES = frozenset("""
    Makefile makefile GNUmakefile Dockerfile Containerfile Vagrantfile Jenkinsfile Gemfile Rakefile
    Procfile Brewfile Pipfile Podfile Fastfile Justfile justfile Snakefile Tiltfile Earthfile Caddyfile
    PKGBUILD APKBUILD BUILD WORKSPACE crontab
""".split())

IMAGE_SUFFIXES = frozenset({"png", "jpg", "jpeg", "jpe", "jfif", "webp", "gif"})

# application/* types whose content is plain text all the same
TEXTUAL_APPLICATION_TYPES = frozenset({
    "application/json", "application/ld+json", "application/xml", "application/javascript",
    "application/ecmascript", "application/x-sh", "application/x-csh", "application/sql",
    "application/toml", "application/yaml", "application/x-yaml", "application/x-httpd-php",
    "application/x-perl", "application/x-python", "application/x-ruby", "application/x-tex",
    "application/x-latex", "application/rtf", "application/xhtml+xml", "application/x-ndjson",
})

# A PDF may carry some junk before its header; readers look within the first KiB.
PDF_MAGIC = b"%PDF-"
PDF_MAGIC_WINDOW = 1024


@dataclass
class Classified:
    """A file's kind and the MIME type recorded for it."""

    kind: Kind
    mime: str


def unsupported(name: str) -> UnsupportedKind:
    """The refusal of a kind chat does not take, naming the kinds it does."""
    return UnsupportedKind(f"{name}: chat supports text, images and PDF")


def suffix_of(name: str) -> str:
    """The last suffix of ``name``, lower-cased, without the dot ('' when none; a dotfile has none)."""
    stem, ext = os.path.splitext(name)
    return ext[1:].lower() if stem else ""


def _image_magic(head: bytes) -> str | None:
    """The MIME type of a PNG, JPEG, GIF or WebP by its magic number, else None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def looks_like_text(head: bytes) -> bool:
    """Whether ``head`` is UTF-8 without NUL bytes (a character cut at the end is allowed)."""
    if b"\x00" in head:
        return False
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        decoder.decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _is_textual(mime: str) -> bool:
    """Whether a MIME type names plain text (text/*, JSON, XML and their +xml/+json kin)."""
    return mime.startswith("text/") or mime in TEXTUAL_APPLICATION_TYPES or mime.endswith(("+xml", "+json"))


def _text_mime(name: str) -> str:
    """The MIME type to record for a text file: the guessed one when textual, else text/plain."""
    guessed, _ = mimetypes.guess_type(name, strict=False)
    if guessed and _is_textual(guessed):
        return guessed
    return "text/plain"


def _pdf_magic(head: bytes) -> bool:
    """Whether ``head`` starts a PDF: ``%PDF-`` first, or after something (readers allow up to
    1 KiB before it) in a file that is not text: a log or a note that mentions ``%PDF-`` is text."""
    return head.startswith(PDF_MAGIC) or PDF_MAGIC in head[:PDF_MAGIC_WINDOW] and not looks_like_text(head)


def is_code(name: str) -> bool:
    """Whether a text file is code (a programming, markup or config language, a build file or a
    dotfile) rather than prose or data, by its name."""
    suffix = suffix_of(name)
    if suffix:
        return suffix in TEXT_SUFFIXES and suffix not in PROSE_SUFFIXES
    return name in CODE_NAMES or name.startswith(".")


def classify(name: str, head: bytes) -> Classified:
    """Classify a file by its ``name`` (base name) and its first bytes; raise UnsupportedKind."""
    suffix = suffix_of(name)
    if suffix == "pdf" or suffix not in TEXT_SUFFIXES and _pdf_magic(head):
        return Classified("pdf", "application/pdf")
    if suffix in TEXT_SUFFIXES or name in TEXT_NAMES or name.lower() in TEXT_NAMES:
        return Classified("text", _text_mime(name))
    magic = _image_magic(head)
    if magic is not None:
        return Classified("image", magic)
    if suffix in IMAGE_SUFFIXES:
        guessed, _ = mimetypes.guess_type(name, strict=False)
        return Classified("image", guessed or "image/" + suffix)
    guessed, _ = mimetypes.guess_type(name, strict=False)
    if guessed and _is_textual(guessed):
        return Classified("text", guessed)
    if looks_like_text(head):
        return Classified("text", "text/plain")
    raise unsupported(name)
