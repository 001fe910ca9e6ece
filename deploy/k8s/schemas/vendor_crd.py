"""Write one vendored schema file (deploy/k8s/schemas/<group>_<kind>.yaml) from an upstream CRD:
the `openAPIV3Schema` of one version, `description` texts left out, under a header that names
where it comes from. Usage (the README's table lists every file's arguments):

    git -C <clone> show <tag>:<path> | python deploy/k8s/schemas/vendor_crd.py VERSION \
        --source "<owner/repo>, <path> at <tag> (commit <sha>)" --license Apache-2.0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent


def without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        # a property that is itself named "description" stays (it is a field, not a text)
        return {k: without_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [without_descriptions(item) for item in node]
    return node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version", help="the CRD version to vendor, e.g. v1alpha2")
    parser.add_argument("--source", required=True, help="repository, path, tag and commit, for the header")
    parser.add_argument("--license", default="Apache-2.0")
    parser.add_argument("--note", default="", help="one more header line (what else was changed)")
    ns = parser.parse_args(argv)
    crd = yaml.safe_load(sys.stdin)
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == ns.version]
    schema = without_descriptions(version["schema"]["openAPIV3Schema"])
    subresources = sorted(version.get("subresources", {}))
    header = [f"{kind}, {group}/{ns.version}: the openAPIV3Schema of the CRD, vendored for offline validation.",
              f"Source: {ns.source}, {ns.license}.",
              "Copied as is except that the `description` texts were left out"
              + (f"; the CRD's subresources: {', '.join(subresources)}." if subresources else ".")]
    if ns.note:
        header.append(ns.note)
    out = HERE / f"{group}_{kind.lower()}.yaml"
    out.write_text("".join(f"# {line}\n" for line in header) + yaml.safe_dump(schema, sort_keys=True, width=120))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
