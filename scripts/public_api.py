#!/usr/bin/env python3
"""The public API of a crate as text, one line per item, method and impl, read from the
HTML that `cargo doc` wrote: the snapshot that `.ci/run` compares with the checked-in
`api/<crate>.txt`, so that every change to the surface is a reviewed diff.

Read from rustdoc's HTML rather than its JSON because the HTML comes from the stable
toolchain that CI already documents the crate with (`cargo doc --all-features`); the
JSON needs a nightly whose format changes. Items hidden with `#[doc(hidden)]` have no
page and are left out; auto-trait and blanket impls are left out (they follow from the
rest). rustdoc leaves the pages of removed items behind: bless from a fresh
`target/doc` (`rm -rf target/doc` first).

Usage:
    scripts/public_api.py [DOC_DIR]              print the snapshot (default target/doc/multiproc)
    scripts/public_api.py --check SNAPSHOT [DOC_DIR]   exit 1 with a diff when they differ
    scripts/public_api.py --bless SNAPSHOT [DOC_DIR]   write the snapshot
"""

import difflib
import html
import os
import re
import sys

ITEM_PAGE = re.compile(
    r"^(struct|enum|trait|fn|type|macro|constant|static|union|derive|attr|traitalias)\.(.+)\.html$"
)
DECL = re.compile(r'<pre class="rust item-decl">(.*?)</pre>', re.S)
HEADER = re.compile(r'<(h3|h4) class="code-header">(.*?)</\1>', re.S)
SECTION = re.compile(r'<section id="([^"]+)"')
# Where the impls that follow from the others begin (auto traits, then blanket impls).
DERIVED = re.compile(r'id="(synthetic-implementations|blanket-implementations)"')
TRAIT_IMPLS = re.compile(r'id="trait-implementations"')


def text(fragment: str) -> str:
    """The fragment's code as plain text on one line."""
    fragment = re.sub(r"<summary[^>]*>.*?</summary>", "", fragment, flags=re.S)
    # The "notable traits" marker after a return type.
    fragment = re.sub(r'<a[^>]*class="tooltip"[^>]*>.*?</a>', "", fragment, flags=re.S)
    fragment = re.sub(r"<(span|div) class=\"where\">", " ", fragment)
    fragment = re.sub(r"<br\s*/?>", " ", fragment)
    fragment = re.sub(r"<[^>]+>", "", fragment)
    fragment = html.unescape(fragment)
    fragment = re.sub(r"\s+", " ", fragment).strip()
    # One spelling of a signature however rustdoc wrapped it.
    fragment = re.sub(r"\( ", "(", fragment)
    fragment = re.sub(r",? \)", ")", fragment)
    fragment = re.sub(r",$", "", fragment)
    # A path's version in a link never shows; `{ /* private fields */ }` says nothing.
    return fragment.replace(" { /* private fields */ }", "")


def page_lines(path: str, rel: str) -> list[str]:
    kind, name = ITEM_PAGE.match(os.path.basename(rel)).groups()
    module = os.path.dirname(rel).replace(os.sep, "::")
    with open(path, encoding="utf-8") as f:
        page = f.read()
    if 'http-equiv="refresh"' in page[:2000]:
        return []  # a redirect to where the item is documented
    decl = DECL.search(page)
    lines = [f"{kind} {module}::{name}" + (f": {text(decl.group(1))}" if decl else "")]
    derived = DERIVED.search(page)
    body = page[: derived.start()] if derived else page
    trait_impls = TRAIT_IMPLS.search(body)
    split = trait_impls.start() if trait_impls else len(body)
    variants = [(m.start(), m.group(1)) for m in SECTION.finditer(body)]
    for m in HEADER.finditer(body):
        section = [sid for at, sid in variants if at < m.start()]
        if section and section[-1].startswith("variant."):
            continue  # the declaration above lists the variants
        line = text(m.group(2))
        if m.group(1) == "h3":
            lines.append(f"    {line}")
        elif m.start() < split:  # a trait impl's methods are the trait's
            lines.append(f"        {line}")
    return lines


def snapshot(doc_dir: str) -> str:
    crate = os.path.basename(os.path.normpath(doc_dir))
    out = []
    for root, _, files in os.walk(doc_dir):
        for file in sorted(files):
            if not ITEM_PAGE.match(file):
                continue
            path = os.path.join(root, file)
            rel = os.path.join(crate, os.path.relpath(path, doc_dir))
            lines = page_lines(path, rel)
            if lines:
                out.append(lines)
    out.sort(key=lambda lines: lines[0])
    return "".join(line + "\n" for lines in out for line in lines)


def main(argv: list[str]) -> int:
    mode, target = None, None
    if argv and argv[0] in ("--check", "--bless"):
        mode, target, argv = argv[0], argv[1], argv[2:]
    doc_dir = argv[0] if argv else "target/doc/multiproc"
    if not os.path.isdir(doc_dir):
        print(f"public_api: no {doc_dir}: run `cargo doc --no-deps --all-features` first", file=sys.stderr)
        return 2
    now = snapshot(doc_dir)
    if mode is None:
        sys.stdout.write(now)
        return 0
    if mode == "--bless":
        with open(target, "w", encoding="utf-8") as f:
            f.write(now)
        return 0
    with open(target, encoding="utf-8") as f:
        before = f.read()
    if before == now:
        return 0
    sys.stdout.writelines(
        difflib.unified_diff(before.splitlines(True), now.splitlines(True), target, "now")
    )
    print(
        f"\nThe public API differs from {target}. If the change is meant, review the diff "
        f"above and run (on a fresh target/doc): python3 scripts/public_api.py --bless {target} {doc_dir}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
