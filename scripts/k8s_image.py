#!/usr/bin/env python3
"""Points every Kubernetes manifest at an image: the one place that names it, and the copy `kubectl apply -f
k8s/` sends.

    python3 scripts/k8s_image.py --image registry.example.com/team/ddp-deploy:0.1.0   # make k8s-image IMAGE=...
    python3 scripts/k8s_image.py --cuda-image registry.example.com/team/ddp-deploy:0.1.0-cuda
    python3 scripts/k8s_image.py            # only bring k8s/pytorchjob.yaml in line with the component
    python3 scripts/k8s_image.py --check    # exit 1 when k8s/pytorchjob.yaml is out of line

One setting serves every job: --image alone also points the GPU overlays at the same name and tag with `-cuda`
appended (registry.example.com/team/ddp-deploy:0.1.0-cuda), the tag `make push` gives the CUDA build;
--cuda-image names another.

The manifests name the image by a placeholder (`ddp-deploy`, and `ddp-deploy-cuda` in the GPU overlays);
k8s/components/image/kustomization.yaml maps each placeholder to a real reference, and every kustomization
(the base, the overlays, the TrainJob) applies it. `kubectl apply -f k8s/` runs no kustomize, so
k8s/pytorchjob.yaml is k8s/base/pytorchjob.yaml with the placeholder already replaced: this script writes
both files, so they cannot disagree. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

K8S = Path(__file__).resolve().parent.parent / "k8s"
COMPONENT = K8S / "components" / "image" / "kustomization.yaml"
BASE_JOB = K8S / "base" / "pytorchjob.yaml"
PLAIN_JOB = K8S / "pytorchjob.yaml"
CPU, CUDA = "ddp-deploy", "ddp-deploy-cuda"  # the placeholders the manifests use

# Docker's reference grammar, lower case: [host[:port]/]path[:tag][@sha256:digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REFERENCE = re.compile(rf"(?P<name>{_COMPONENT}(?::[0-9]+)?(?:/{_COMPONENT})*)"
                       r"(?::(?P<tag>\w[\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?")


class ImageError(ValueError):
    pass


@dataclass(frozen=True)
class Image:
    name: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, reference: str, setting: str) -> Image:
        match = REFERENCE.fullmatch(reference)
        if match is None:
            raise ImageError(f"{setting}={reference} is not an image reference: [host[:port]/]path:tag, lower case, "
                             f"no scheme (e.g. {setting}=registry.example.com/team/ddp-deploy:0.1.0)")
        if match["tag"] is None and match["digest"] is None:
            raise ImageError(f"{setting}={reference} names no tag: give the version (e.g. {reference}:0.1.0); nodes "
                             "keep an image they have (imagePullPolicy: IfNotPresent), so a moving tag goes stale")
        return cls(match["name"], match["tag"], match["digest"])

    def __str__(self) -> str:
        return self.name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    def cuda_build(self) -> Image:
        """The CUDA build pushed beside this CPU image: `make push` tags it TAG-cuda (scripts/push-image.sh)."""
        if self.tag is None:
            raise ImageError(f"IMAGE={self} names its image by digest alone, so the CUDA build's cannot be derived "
                             "from it: give CUDA_IMAGE too (e.g. CUDA_IMAGE=registry.example.com/team/"
                             "ddp-deploy:0.1.0-cuda)")
        return Image(self.name, f"{self.tag}-cuda", None)

    def kustomize_entry(self, placeholder: str) -> str:
        fields = [f"  - name: {placeholder}", f"    newName: {self.name}"]
        fields += [f'    newTag: "{self.tag}"'] if self.tag else []
        fields += [f"    digest: {self.digest}"] if self.digest else []
        return "\n".join(fields)


def read_component() -> dict[str, Image]:
    """The placeholder -> image mapping the component holds now."""
    entries = re.findall(r'- name: (\S+)\n\s+newName: (\S+)\n(?:\s+newTag: "?([^"\n]+)"?\n)?(?:\s+digest: (\S+)\n)?',
                         COMPONENT.read_text())
    images = {placeholder: Image(name, tag or None, digest or None) for placeholder, name, tag, digest in entries}
    if set(images) != {CPU, CUDA}:
        raise ImageError(f"{COMPONENT} maps {sorted(images)}, not {CPU} and {CUDA}: restore it from git")
    return images


def component_text(images: dict[str, Image]) -> str:
    return f"""# The images every job runs: the one place that names them. The manifests use the placeholders below
# (`{CPU}`; `{CUDA}` in the GPU overlays) and every kustomization applies this component. Change it with
#   make k8s-image IMAGE=registry.example.com/team/ddp-deploy:0.1.0 [CUDA_IMAGE=...; default :0.1.0-cuda]
# which also rewrites k8s/pytorchjob.yaml, the copy `kubectl apply -f k8s/` sends (no kustomize there).
apiVersion: kustomize.config.k8s.io/v1alpha1
kind: Component
images:
  # The CPU build (docker/Dockerfile's defaults): k8s/, the base and the CPU overlays.
{images[CPU].kustomize_entry(CPU)}
  # The CUDA build (docker/Dockerfile on a CUDA PyTorch base image): the GPU overlays.
{images[CUDA].kustomize_entry(CUDA)}
"""


def plain_job_text(image: Image) -> str:
    base = BASE_JOB.read_text()
    placeholder = re.compile(rf"^(\s*image: ){re.escape(CPU)}$", re.M)
    if len(placeholder.findall(base)) != 1:
        raise ImageError(f"{BASE_JOB} must name its image exactly once as `image: {CPU}` (the placeholder)")
    header = ("# Generated by `make k8s-image` from k8s/base/pytorchjob.yaml and k8s/components/image: edit those and\n"
              "# run it again. `kubectl apply -f k8s/` sends this copy; kustomize (apply -k) reads the base.\n")
    return header + placeholder.sub(lambda match: f"{match[1]}{image}", base)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", help="the CPU image, e.g. registry.example.com/team/ddp-deploy:0.1.0")
    parser.add_argument("--cuda-image", help="the CUDA image the GPU overlays run (default with --image: its tag "
                        "with -cuda appended)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the files disagree")
    args = parser.parse_args(argv)
    try:
        images = read_component()
        if args.image:
            images[CPU] = Image.parse(args.image, "IMAGE")
        if args.cuda_image:
            images[CUDA] = Image.parse(args.cuda_image, "CUDA_IMAGE")
        elif args.image:
            images[CUDA] = images[CPU].cuda_build()
        wanted = {COMPONENT: component_text(images), PLAIN_JOB: plain_job_text(images[CPU])}
    except ImageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stale = [path for path, text in wanted.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"error: {path.relative_to(K8S.parent)} is out of date: run make k8s-image", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        if path.is_symlink():
            path.unlink()
        path.write_text(wanted[path])
    print(f"the manifests run {images[CPU]} (GPU overlays: {images[CUDA]}); kubectl apply -f k8s/ or -k k8s/...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
