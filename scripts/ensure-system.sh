#!/usr/bin/env bash
# Installs the Debian packages Shoal's sandboxes need (runtime/debian-packages.txt),
# or those of another list given as the argument (make test: runtime/test-packages.txt).
# As root it uses apt-get; otherwise it names what is missing and how to get it,
# and fails, because Shoal never runs code without its isolation tools.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
list="${1:-$here/runtime/debian-packages.txt}"
missing=()
while read -r package; do
    case "$package" in ''|\#*) continue ;; esac
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$package")
    fi
done < "$list"
# The runtime build fetches Bun with npm. Node.js builds that carry their own npm
# (NodeSource's) conflict with Debian's npm package, so it is only asked for
# when no npm command exists.
if [ "$list" = "$here/runtime/debian-packages.txt" ] && ! command -v npm >/dev/null; then
    missing+=(npm)
fi
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "shoal: missing system packages: ${missing[*]}" >&2
    echo "shoal: install them with: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "shoal: missing ${missing[*]} and no apt-get to install them; install them by hand" >&2
    exit 1
fi
echo "shoal: installing system packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
