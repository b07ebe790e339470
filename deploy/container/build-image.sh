#!/bin/sh
# Builds haltd's container image from Debian packages alone: no image registry is needed.
#
#   deploy/container/build-image.sh target/dist/haltd_0.1.0_amd64.deb [TAG]
#
# 1. A minimal Debian root file system, by debootstrap from a Debian mirror (or from a
#    tarball of an earlier one: HALTD_IMAGE_BASE, made on the first run).
# 2. haltd's Debian package (`cargo xtask dist`) installed in it with dpkg, as on a host:
#    its dependencies are checked, its files and conffiles registered.
# 3. The root file system as one tarball, and `podman build` with the Containerfile beside
#    this script (FROM scratch, ADD rootfs.tar).
#
# Environment: HALTD_IMAGE_SUITE (bookworm), HALTD_IMAGE_MIRROR (http://deb.debian.org/debian),
# HALTD_IMAGE_BASE (a cached base tarball), HALTD_IMAGE_WORK (the work directory; a fresh
# temporary one by default, removed at the end unless HALTD_IMAGE_KEEP=1 keeps the installed
# root in $HALTD_IMAGE_WORK/rootfs), PODMAN (the podman command; by default
# `podman --runtime runc --cgroup-manager=cgroupfs`, what works on a hybrid cgroup layout).
# Run as root (debootstrap, chroot, rootful podman).
set -eu

[ $# -ge 1 ] && [ $# -le 2 ] || {
    echo "usage: $0 HALTD_DEB [TAG]" >&2
    exit 2
}
deb=$(realpath "$1")
tag=${2:-localhost/haltd:latest}
here=$(cd "$(dirname "$0")" && pwd)
suite=${HALTD_IMAGE_SUITE:-bookworm}
mirror=${HALTD_IMAGE_MIRROR:-http://deb.debian.org/debian}
base=${HALTD_IMAGE_BASE:-}
podman=${PODMAN:-podman --runtime runc --cgroup-manager=cgroupfs}
if [ -n "${HALTD_IMAGE_WORK:-}" ]; then
    work=$HALTD_IMAGE_WORK
    mkdir -p "$work"
else
    work=$(mktemp -d)
fi
rootfs=$work/rootfs
context=$work/context
rm -rf "$rootfs" "$context"
mkdir -p "$rootfs" "$context"

step() { echo "[image] $*"; }

if [ -n "$base" ] && [ -f "$base" ]; then
    step "base: $base"
    tar -C "$rootfs" -xf "$base"
else
    step "base: debootstrap --variant=minbase $suite from $mirror"
    debootstrap --variant=minbase "$suite" "$rootfs" "$mirror"
    if [ -n "$base" ]; then
        tar -C "$rootfs" --numeric-owner -cf "$base" .
    fi
fi

step "installing $(basename "$deb")"
cp "$deb" "$rootfs/tmp/haltd.deb"
chroot "$rootfs" dpkg -i /tmp/haltd.deb
rm "$rootfs/tmp/haltd.deb"
chroot "$rootfs" /usr/bin/haltd --version
# What the unit's StateDirectory= and RuntimeDirectory= make under systemd.
install -d -m 0750 "$rootfs/var/lib/haltd"
install -d -m 0755 "$rootfs/run/haltd"
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/*.log \
    "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/lib/dpkg/*-old

step "root file system: $(du -sh "$rootfs" | cut -f1)"
tar -C "$rootfs" --numeric-owner -cf "$context/rootfs.tar" .
cp "$here/Containerfile" "$context/Containerfile"
step "podman build -t $tag"
$podman build --file "$context/Containerfile" --tag "$tag" "$context"
rm -rf "$context"
if [ "${HALTD_IMAGE_KEEP:-0}" != 1 ]; then
    rm -rf "$rootfs"
    [ -n "${HALTD_IMAGE_WORK:-}" ] || rmdir "$work"
fi
step "built $tag"
