#!/usr/bin/env python3
"""The module dependency picture of crates/multiproc/src.

Reads every `use` statement and every inline `crate::` / `super::` path of the crate's
source (test modules left out: `tests.rs` files and everything from a `#[cfg(test)]`
`mod tests` on), resolves each path to the file that defines what it names (following
`pub use` re-exports, including lib.rs's), and prints:

- the order of the top-level modules, lowest layer first (modules in one cycle are
  printed together, in brackets);
- every cycle between top-level modules, with one import per edge as evidence;
- every cycle between files;
- the imports that go through lib.rs's re-exports (`crate::Error` instead of
  `crate::error::Error`), by file.

Usage: scripts/module_deps.py [--src crates/multiproc/src] [--quiet] [--check]

With --check it exits with status 1 when there is a cycle or an import through lib.rs's
re-exports (`.ci/run` runs it so).
"""

import argparse
import os
import re
import sys
from collections import defaultdict

USE_RE = re.compile(r"\buse\s+([^;]+);")
INLINE_RE = re.compile(r"(?<![$\w])((?:crate|super)(?:::\w+)+)")
PATH_ATTR_RE = re.compile(r'#\[path\s*=\s*"([^"]+)"\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)')


def strip_comments(text):
    text = text.replace("'\"'", "' '").replace("'\\\"'", "' '")
    lines = []
    for line in text.split("\n"):
        # Strip `//` comments outside string literals (good enough for this crate).
        out, in_str, i = [], False, 0
        while i < len(line):
            c = line[i]
            if c == '"' and (i == 0 or line[i - 1] != "\\"):
                in_str = not in_str
            if not in_str and line.startswith("//", i):
                break
            out.append(c)
            i += 1
        lines.append("".join(out))
    return re.sub(r"/\*.*?\*/", "", "\n".join(lines), flags=re.S)


def strip_strings(text):
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text, flags=re.S)


def cut_tests(text):
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{", text)
    return text[: m.start()] if m else text


def expand_use(tree):
    """`a::{b, c::{d, e as f}}` -> [(['a','b'], 'b'), (['a','c','d'], 'd'), (['a','c','e'], 'f')]."""
    tree = re.sub(r"\s+as\s+", "@", tree)
    tree = re.sub(r"\s+", "", tree)

    def parse(s, prefix):
        if "{" not in s:
            body, _, alias = s.partition("@")
            segs = prefix + [p for p in body.split("::") if p]
            if segs and segs[-1] == "self":
                segs = segs[:-1]
            return [(segs, alias or segs[-1])] if segs else []
        i = s.index("{")
        head = [p for p in s[:i].split("::") if p]
        inner = s[i + 1 : s.rindex("}")]
        depth, start, parts = 0, 0, []
        for j, c in enumerate(inner):
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            elif c == "," and depth == 0:
                parts.append(inner[start:j])
                start = j + 1
        parts.append(inner[start:])
        out = []
        for p in parts:
            if p:
                out.extend(parse(p, prefix + head))
        return out

    return parse(tree, [])


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = {}  # module tuple -> relative file path
        self.texts = {}
        self.reexports = defaultdict(dict)  # module -> name -> absolute path
        path_mods = {}
        lib = open(os.path.join(src, "lib.rs")).read()
        for file, name in PATH_ATTR_RE.findall(lib):
            path_mods[file] = name
        for root, _, names in os.walk(src):
            for n in names:
                if not n.endswith(".rs"):
                    continue
                rel = os.path.relpath(os.path.join(root, n), src)
                if os.path.basename(rel) == "tests.rs":
                    continue
                parts = rel[:-3].split(os.sep)
                if parts == ["lib"]:
                    mod = ()
                elif parts[-1] == "mod":
                    mod = tuple(parts[:-1])
                elif len(parts) == 1 and rel in path_mods:
                    mod = (path_mods[rel],)
                else:
                    mod = tuple(parts)
                self.files[mod] = rel
                raw = open(os.path.join(src, rel)).read()
                self.texts[mod] = strip_strings(cut_tests(strip_comments(raw)))
        for mod, text in self.texts.items():
            for m in USE_RE.finditer(text):
                stmt_start = text.rfind("\n", 0, m.start()) + 1
                is_pub = text[stmt_start : m.start()].strip().startswith("pub")
                if not is_pub:
                    continue
                for segs, alias in self.expand(mod, m.group(1)):
                    self.reexports[mod][alias] = segs

    def expand(self, mod, tree):
        out = []
        for segs, alias in expand_use(tree):
            abs_ = self.absolute(mod, segs)
            if abs_ is not None:
                out.append((abs_, alias))
        return out

    def absolute(self, mod, segs):
        segs = list(segs)
        if segs[0] == "crate":
            return segs[1:]
        base = list(mod)
        if segs[0] == "self":
            return base + segs[1:]
        if segs[0] == "super":
            while segs and segs[0] == "super":
                base = base[:-1]
                segs = segs[1:]
            return base + segs
        if tuple(base + [segs[0]]) in self.files:
            return base + segs
        if mod == () and (segs[0],) in self.files:
            return segs
        return None  # an external crate or a local item

    def resolve(self, segs, depth=0):
        """The module that defines the item `segs` names, and whether the path went
        through lib.rs's re-exports."""
        via_lib = False
        for _ in range(20):
            k = len(segs)
            while k > 0 and tuple(segs[:k]) not in self.files:
                k -= 1
            mod = tuple(segs[:k])
            rest = segs[k:]
            if rest and rest[0] in self.reexports.get(mod, {}):
                if mod == ():
                    via_lib = True
                segs = self.reexports[mod][rest[0]] + rest[1:]
                continue
            return mod, via_lib
        return tuple(segs[:1]), via_lib


def collect(crate):
    """edges[(from_file_mod, to_file_mod)] = [evidence]; via_lib[file] = [paths]."""
    edges = defaultdict(list)
    via_lib = defaultdict(list)
    for mod, text in crate.texts.items():
        refs = []
        for m in USE_RE.finditer(text):
            for segs, _ in expand_use(m.group(1)):
                refs.append(segs)
        no_use = USE_RE.sub("", text)
        for m in INLINE_RE.finditer(no_use):
            refs.append(m.group(1).split("::"))
        for segs in refs:
            abs_ = crate.absolute(mod, segs)
            if abs_ is None:
                continue
            target, through_lib = crate.resolve(abs_)
            if through_lib and mod != ():
                via_lib[crate.files[mod]].append("::".join(segs))
            if target != mod and not is_ancestor(target, mod):
                edges[(mod, target)].append("::".join(segs))
    return edges, via_lib


def is_ancestor(a, b):
    """A module's own parents (mod.rs files) hold its re-exports, not its layer."""
    return len(a) < len(b) and tuple(b[: len(a)]) == a


def sccs(nodes, succ):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out  # reverse topological: dependencies first


def top(mod):
    return mod[0] if mod else "lib"


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--src", default=os.path.join(here, "..", "crates", "multiproc", "src"))
    ap.add_argument("--quiet", action="store_true", help="only the order and the cycles")
    ap.add_argument(
        "--check", action="store_true", help="exit with status 1 when there is any cycle"
    )
    args = ap.parse_args()
    crate = Crate(os.path.normpath(args.src))
    edges, via_lib = collect(crate)

    top_edges = defaultdict(list)
    for (a, b), ev in edges.items():
        if top(a) != top(b) and a != () and b != ():
            top_edges[(top(a), top(b))].append(f"{crate.files[a]}: {ev[0]}")
    nodes = {top(m) for m in crate.files if m != ()}
    succ = defaultdict(set)
    for a, b in top_edges:
        succ[a].add(b)
    comps = sccs(nodes, succ)
    # Layers: a module sits one above the highest module it uses (a cycle is one node).
    comp_of = {v: i for i, c in enumerate(comps) for v in c}
    level = {}
    for i, c in enumerate(comps):  # dependencies come first
        deps = {comp_of[w] for v in c for w in succ.get(v, ()) if comp_of[w] != i}
        level[i] = 1 + max((level[d] for d in deps), default=-1)
    print("Top-level modules by layer, lowest first (a cycle in brackets):")
    for lv in range(max(level.values()) + 1):
        names = sorted(
            (c[0] if len(c) == 1 else "[" + " ".join(c) + "]")
            for i, c in enumerate(comps)
            if level[i] == lv
        )
        print(f"  {lv}: " + "  ".join(names))
    cyc = [c for c in comps if len(c) > 1]
    print(f"\nCycles between top-level modules: {len(cyc)}")
    for c in cyc:
        print("  [" + " ".join(c) + "]")
        for a in c:
            for b in c:
                if (a, b) in top_edges:
                    print(f"    {a} -> {b}   ({top_edges[(a, b)][0]})")

    fsucc = defaultdict(set)
    for a, b in edges:
        if a != () and b != ():
            fsucc[a].add(b)
    fcomps = [c for c in sccs(set(crate.files) - {()}, fsucc) if len(c) > 1]
    print(f"\nCycles between files: {len(fcomps)}")
    for c in fcomps:
        print("  [" + " ".join(crate.files[m] for m in c) + "]")
        for a in c:
            for b in c:
                if (a, b) in edges:
                    print(f"    {crate.files[a]} -> {crate.files[b]}   ({edges[(a, b)][0]})")

    if args.check and (cyc or fcomps):
        raise SystemExit("module_deps: the layers have a cycle (see above)")

    total = sum(len(v) for v in via_lib.values())
    print(f"\nImports through lib.rs re-exports: {total} in {len(via_lib)} files")
    if not args.quiet or args.check:
        for f in sorted(via_lib):
            print(f"  {f}: {', '.join(sorted(set(via_lib[f])))}")
    if args.check and total:
        raise SystemExit(
            "module_deps: import these from the module that defines them, not through "
            "lib.rs's re-exports (see above)"
        )


if __name__ == "__main__":
    main()
