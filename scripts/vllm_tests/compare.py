"""Compare two junit reports of the same vLLM tests: vLLM 0.33 itself, then kvlab through
``kvlab_adapter.py``. A test counts when it passed on vLLM (that is what "valid on 0.33"
means on this machine: no GPU, no compiled extension); the table says how many of those pass
on kvlab, per file, and the commonest failure messages.

    python compare.py vllm.xml kvlab.xml [--messages N]
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        state, message = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                state, message = "fail", (child.get("message") or "").splitlines()[0][:120] if child.get("message") else ""
                break
            if child.tag == "skipped":
                state = "skip"
                break
        out[key] = (state, message)
    return out


def test_file(key: str) -> str:
    parts = key.split("::")[0].split(".")
    return "/".join(p for p in parts if not p[:1].isupper()) + ".py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vllm_xml")
    ap.add_argument("kvlab_xml")
    ap.add_argument("--messages", type=int, default=15)
    args = ap.parse_args()
    real, kv = outcomes(args.vllm_xml), outcomes(args.kvlab_xml)
    per_file: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    messages: collections.Counter[str] = collections.Counter()
    for key, (state, _) in real.items():
        if state != "pass":
            continue
        counts = per_file[test_file(key)]
        counts[1] += 1
        outcome, message = kv.get(key, ("fail", "(not collected on kvlab: its file failed to import)"))
        if outcome == "pass":
            counts[0] += 1
        else:
            messages[message or "(no message)"] += 1
    passed, valid = sum(c[0] for c in per_file.values()), sum(c[1] for c in per_file.values())
    print(f"{'kvlab':>6} {'vLLM':>6}  file")
    for name, (a, b) in sorted(per_file.items()):
        print(f"{a:6d} {b:6d}  {name}")
    print(f"{passed:6d} {valid:6d}  all: of the tests that pass on vLLM 0.33 here, {passed} pass on kvlab")
    if args.messages:
        print("\ncommonest failures on kvlab:")
        for message, n in messages.most_common(args.messages):
            print(f"{n:6d}  {message}")


if __name__ == "__main__":
    main()
