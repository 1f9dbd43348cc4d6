#!/usr/bin/env bash
# Install check for Raspberry Pi OS (64-bit): an arm64 Debian bookworm userland (the base of Raspberry Pi OS
# 64-bit, Python 3.11) made with debootstrap and run on this x86-64 host under qemu-user emulation. Inside it,
# as a Pi user would: a venv, pip install of edgetrain's wheel built from this checkout (pip picks the newest
# aarch64 torch of the package's range from PyPI), import, a plan, a few training steps on 2 devices, a peak
# bench. Wall times are emulated: they say nothing about a Pi's speed.
#
#   sudo benchmarks/install_check_arm64.sh [ROOTFS] | tee benchmarks/results/install_check_arm64.txt
#
# Needs root (debootstrap, chroot, mounts), Debian's debootstrap, qemu-user-static and binfmt-support
# (apt-get install -y debootstrap qemu-user-static binfmt-support) and PyPI/Debian mirrors. Re-runnable: the
# rootfs (default /var/tmp/edgetrain-arm64-root, outside the repo) and its venv are kept; edgetrain is
# reinstalled from a fresh wheel each time. QEMU_CPU: the core emulated, cortex-a72 (Raspberry Pi 4, ARMv8.0, the
# default) or cortex-a76 (Pi 5, ARMv8.2); the chroot's /proc/cpuinfo is a Pi's for it (under qemu-user it would be
# the x86 host's, on which torch's cpuinfo library crashes at import). TORCH_SPEC (e.g. 'torch<2.11'; default: none, the package's own
# range) constrains torch; each TORCH_SPEC gets its own venv in the rootfs.
set -euo pipefail
root=${1:-/var/tmp/edgetrain-arm64-root}
suite=bookworm
mirror=${MIRROR:-http://deb.debian.org/debian}
steps=${STEPS:-20}
die() { echo "install_check_arm64: $*" >&2; exit 2; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot and mounts); run it with sudo"
command -v debootstrap >/dev/null || die "debootstrap not found; apt-get install -y debootstrap qemu-user-static binfmt-support"
qemu=$(command -v qemu-aarch64-static || true)
[ -n "$qemu" ] || die "qemu-aarch64-static not found; apt-get install -y qemu-user-static binfmt-support"
# The kernel runs arm64 binaries through qemu only with a binfmt_misc entry ('F' flag: works inside the chroot).
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
  || die "cannot mount binfmt_misc (a container without the privilege?); arm64 binaries cannot run here"
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 \
  || die "no binfmt entry for qemu-aarch64; apt-get install -y binfmt-support, then update-binfmts --enable qemu-aarch64"
grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 || die "binfmt entry qemu-aarch64 is disabled; update-binfmts --enable qemu-aarch64"

repo=$(cd "$(dirname "$0")/.." && pwd)
export QEMU_CPU=${QEMU_CPU:-cortex-a72}
case $QEMU_CPU in  # what a Pi's /proc/cpuinfo says of each core: Pi 4 (BCM2711), Pi 5 (BCM2712)
  cortex-a72) part=0xd08 variant=0x0 rev=3 feat="fp asimd evtstrm crc32 cpuid" model="Raspberry Pi 4 Model B" ;;
  cortex-a76) part=0xd0b variant=0x4 rev=1 model="Raspberry Pi 5 Model B"
              feat="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp" ;;
  *) die "QEMU_CPU=$QEMU_CPU: use cortex-a72 (Raspberry Pi 4) or cortex-a76 (Raspberry Pi 5)" ;;
esac
secs() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(secs)" 'BEGIN { printf "%.1f s", b - a }'; }

echo "== host"; date -u +%Y-%m-%dT%H:%M:%SZ; uname -srm; echo "qemu: $("$qemu" --version | head -1), QEMU_CPU=$QEMU_CPU ($model)"
echo "debootstrap: $(dpkg-query -W -f='${Version}' debootstrap 2>/dev/null || echo '?')"
echo "edgetrain checkout: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$repo" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"

echo "== arm64 $suite userland at $root"
if [ -f "$root/.edgetrain-debootstrap-done" ]; then
  echo "kept from an earlier run (delete $root to make it again); its debootstrap: $(grep -E '^real|installed' "$root.debootstrap.log" 2>/dev/null | tr '\n\t' '  ')"
else
  t=$(secs)
  mkdir -p "$root"
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    "$suite" "$root" "$mirror" > "$root.debootstrap.log" 2>&1 || die "debootstrap failed; see $root.debootstrap.log"
  touch "$root/.edgetrain-debootstrap-done"
  echo "real $(took "$t")" >> "$root.debootstrap.log"
  echo "debootstrap --arch=arm64 --variant=minbase: $(took "$t")"
fi

# proc, sys, dev and the host's DNS inside the chroot; unmounted on any exit.
mounted=()
cleanup() { for ((i=${#mounted[@]}-1; i>=0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done; }
trap cleanup EXIT
for m in proc sys dev dev/pts dev/shm; do
  mountpoint -q "$root/$m" && continue
  mkdir -p "$root/$m"
  case $m in proc) mount -t proc proc "$root/proc" ;; sys) mount -t sysfs sys "$root/sys" ;;
             dev/shm) mount -t tmpfs shm "$root/dev/shm" ;; *) mount --bind "/$m" "$root/$m" ;; esac
  mounted+=("$root/$m")
done
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
for ((c=0; c<$(nproc); c++)); do  # a Pi's /proc/cpuinfo, one entry per core this host lends
  printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\n' "$c" "$feat"
  printf 'CPU variant\t: %s\nCPU part\t: %s\nCPU revision\t: %s\n\n' "$variant" "$part" "$rev"
done > "$root/opt/cpuinfo"; printf 'Model\t\t: %s (emulated)\n' "$model" >> "$root/opt/cpuinfo"
mount --bind "$root/opt/cpuinfo" "$root/proc/cpuinfo"; mounted+=("$root/proc/cpuinfo")
# pip inside trusts the host's CA bundle too (a host behind a TLS-inspecting proxy: its CA is only there).
cp -L "${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}" "$root/opt/host-ca.crt" 2>/dev/null \
  || cp "$root/etc/ssl/certs/ca-certificates.crt" "$root/opt/host-ca.crt"
venv=/opt/et${TORCH_SPEC:+-$(printf %s "$TORCH_SPEC" | tr -c 'A-Za-z0-9.' _)}
in_arm() { chroot "$root" /usr/bin/env -i HOME=/root PATH=$venv/bin:/usr/bin:/bin LANG=C.UTF-8 PYTHONUNBUFFERED=1 \
             PIP_CERT=/opt/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 QEMU_CPU="$QEMU_CPU" "$@"; }
echo "uname -m inside: $(in_arm uname -m); $(in_arm /usr/bin/python3 --version); $(grep PRETTY "$root/etc/os-release")"

echo "== edgetrain wheel built on the host from $repo"
dist="$root/opt/dist"; rm -rf "$dist"; mkdir -p "$dist"
t=$(secs)
py=$(command -v python3)
# A copy without build outputs, so that the wheel holds only the checkout's sources.
src=$(mktemp -d); trap 'cleanup; rm -rf "$src"' EXIT
(cd "$repo" && tar --exclude=.venv --exclude=build --exclude='*.egg-info' --exclude=runs --exclude=.git -cf - .) | tar -C "$src" -xf -
"$py" -m pip wheel -q --no-deps -w "$dist" "$src" > /dev/null || die "pip wheel of the checkout failed"
whl=$(basename "$(ls "$dist"/edgetrain-*.whl)")
echo "$whl ($(took "$t"))"

echo "== venv $venv and pip install ${TORCH_SPEC:+'$TORCH_SPEC' }edgetrain inside (arm64, emulated)"
t=$(secs)
[ -x "$root$venv/bin/python" ] || in_arm /usr/bin/python3 -m venv "$venv"
echo "venv: $(took "$t")"
t=$(secs)
# As a Pi user: pip resolves torch from the package's own range (or TORCH_SPEC), the other dependencies too.
in_arm pip install -q ${TORCH_SPEC:+"$TORCH_SPEC"} "/opt/dist/$whl" || die "pip install in the arm64 venv failed (above)"
in_arm pip install -q --force-reinstall --no-deps "/opt/dist/$whl"
echo "pip install (torch, numpy, scikit-learn, matplotlib, ... and edgetrain): $(took "$t")"
in_arm pip list 2>/dev/null | grep -iE '^(torch|numpy|scikit-learn|scipy|matplotlib|PyYAML|psutil|rich|edgetrain|nvidia|triton)[- ]' || true
sp=$(echo "$root$venv"/lib/python3*/site-packages)
echo "site-packages: $(du -sh "$sp" | cut -f1), of which CUDA (nvidia, triton, cuda-*): $(du -shc "$sp"/nvidia \
  "$sp"/triton "$sp"/cuda* 2>/dev/null | tail -1 | cut -f1)"
in_arm python -c 'from importlib.metadata import requires
cuda = [r for r in requires("torch") or [] if any(k in r.lower() for k in ("cuda", "nvidia", "triton"))]
print("torch requires on every Linux machine:", [r for r in cuda if "x86_64" not in r] or "no CUDA package")' || true

echo "== import"
t=$(secs)
in_arm python -c 'import platform, sys, torch, edgetrain, edgetrain.cli
print("python", sys.version.split()[0], platform.machine(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| threads", torch.get_num_threads(), "| gloo", torch.distributed.is_gloo_available())' \
  || die "torch or edgetrain does not import in the arm64 venv (above)"
echo "import torch, edgetrain: $(took "$t")"

run() {  # a timed edgetrain command inside; its last lines
  local t; t=$(secs); echo "\$ edgetrain $*"
  local rc=0; in_arm timeout 1800 edgetrain "$@" > "$root/tmp/out.txt" 2>&1 || rc=$?
  tail -n "${TAIL:-8}" "$root/tmp/out.txt"; echo "exit $rc, wall $(took "$t") (emulated)"
}
rm -rf "$root/tmp/runs"
echo "== plan (modelled, no training)"
TAIL=14 run plan --devices 2 --profile rpi4 --output /tmp/runs
echo "== train: digits, small_cnn, 2 devices, $steps steps"
TAIL=12 run train --devices 2 --steps "$steps" --no-progress --output /tmp/runs --run-name train
ls "$root/tmp/runs/train" 2>/dev/null | tr '\n' ' '; echo
echo "== bench peak (GEMM/LINPACK GFLOPS of the emulated CPU)"
TAIL=10 run bench peak --gemm-sizes 256 --linpack-sizes 256 --min-time 0.5 --output /tmp/runs
echo "== done $(date -u +%H:%M:%SZ)"
