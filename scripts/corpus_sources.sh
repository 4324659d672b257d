#!/usr/bin/env bash
# Install the Debian text packages that kdray.drafter_corpus reads as prompt sources (idempotent: installs only
# what is missing). The builder runs without them too, with fewer sources, and its manifest names the missing ones.
#
#   wamerican     /usr/share/dict/words                 topic seeds (explanation, writing, conversation)
#   dict-foldoc   /usr/share/dictd/foldoc.{index,dict.dz} computing terms with definitions
#   manpages, manpages-dev                              manual pages (sections 2, 3, 5, 7); man1 comes with each tool
set -euo pipefail
PACKAGES=(wamerican dict-foldoc manpages manpages-dev)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "corpus sources: all installed (${PACKAGES[*]})"
  exit 0
fi
SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
$SUDO apt-get update -qq
# man pages are often excluded in slim images (dpkg path-exclude); the builder reads whatever is present.
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "corpus sources: installed ${missing[*]}"
