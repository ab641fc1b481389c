#!/usr/bin/env bash
# Installs what shoal needs on a fresh Debian 12 machine, idempotently:
# the Debian packages (apt-get, as root) and the project venv (.venv) with the
# pinned Python tooling of tools/requirements.txt. Sourced or run by
# scripts/test.sh and scripts/demo.sh. Non-root users: run the printed
# apt-get command with sudo once, then rerun.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

PKGS=(build-essential cmake pkg-config git python3 python3-venv
      libzmq3-dev libmsgpack-dev libuv1-dev libjansson-dev libpcre2-dev
      libhttp-parser-dev libsodium-dev libncurses-dev libcurl4-openssl-dev
      clang libclang-rt-14-dev libomp-14-dev
      libsimde-dev)
# extra tools used by the full suite (network namespaces, sshd, tmux)
PKGS+=(iproute2 tmux)
# promtool (Debian package prometheus, 19 MB, ~25 s to install): `promtool check metrics`
# on both processes' /metrics and `check`/`test rules` on deploy/prometheus-alerts.yml
# (tests/e2e/test_promtool.py, skipped by name without it)
PKGS+=(prometheus)
# the cluster page's test in a real browser (tests/e2e/test_webui.py, skipped by name without
# it): Debian's chromium, 81 MB download, ~60 s to install on a 2-core machine
PKGS+=(chromium)
# deployment and the multi-host test (docs/DEPLOY.md): Ansible, sshd per namespace, rsync
PKGS+=(ansible-core openssh-server openssh-client rsync)
# systemd-analyze verify on the rendered units (works without systemd as PID 1); python3-apt
# for the playbook's apt task on the namespace hosts (without it Ansible would download it)
PKGS+=(systemd python3-apt)

missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        echo "deps: installing Debian packages: ${missing[*]}" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq || { echo "deps: apt-get update failed" >&2; exit 1; }
        apt-get install -y -qq "${missing[@]}" >/dev/null || { echo "deps: apt-get install failed for: ${missing[*]}" >&2; exit 1; }
    else
        echo "deps: missing Debian packages: ${missing[*]}" >&2
        echo "deps: run as root:  sudo apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
fi

# Project venv with pinned test tooling (never PyTorch: fixtures are committed).
venv="$here/.venv"
req="$here/tools/requirements.txt"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python3" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "deps: preparing Python venv $venv" >&2
    python3 -m venv "$venv" || { echo "deps: python3 -m venv failed (install python3-venv)" >&2; exit 1; }
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$req" \
        || { echo "deps: pip install -r tools/requirements.txt failed" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
