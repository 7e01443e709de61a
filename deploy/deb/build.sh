#!/usr/bin/env bash
# Builds target/deb/outbox-relay_<version>_<arch>.deb around a relay binary:
#   deploy/deb/build.sh [BINARY]     (default target/release/outbox-relay)
# DEB_OUT: the output directory (target/deb); DEB_COMPRESS: xz (default) or
# gzip (fast: tests/it/package.rs packages the debug binary).
# `make deb` builds the release binary first, and passes it and DEB_OUT
# from cargo's target directory (CARGO_TARGET_DIR when set). Needs only dpkg-deb and
# objdump (binutils): no cargo-deb, so `make test` can package too.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bin=${1:-target/release/outbox-relay}
[[ -x $bin ]] || { echo "build.sh: no relay binary at $bin (make deb builds it)" >&2; exit 1; }

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
out=${DEB_OUT:-target/deb}
root=$(mktemp -d "${TMPDIR:-/tmp}/outbox-relay-deb.XXXXXX")
trap 'rm -rf "$root"' EXIT
chmod 0755 "$root"

install -D -m 0755 "$bin" "$root/usr/bin/outbox-relay"
install -D -m 0644 deploy/systemd/outbox-relay.service "$root/lib/systemd/system/outbox-relay.service"
install -D -m 0640 examples/outbox-relay.toml "$root/etc/outbox-relay/outbox-relay.toml"
install -d -m 0750 "$root/etc/outbox-relay"
for f in sql/*.sql; do install -D -m 0644 "$f" "$root/usr/share/outbox-relay/$f"; done
for f in schema/*.json; do install -D -m 0644 "$f" "$root/usr/share/outbox-relay/$f"; done
install -D -m 0644 deploy/prometheus/outbox-relay.rules.yml "$root/usr/share/outbox-relay/prometheus/outbox-relay.rules.yml"
install -D -m 0644 deploy/grafana/outbox-relay.json "$root/usr/share/outbox-relay/grafana/outbox-relay.json"
install -D -m 0644 README.md "$root/usr/share/doc/outbox-relay/README.md"
cat > "$root/usr/share/doc/outbox-relay/copyright" <<COPY
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: outbox-relay
License: Apache-2.0

Files: *
Copyright: the outbox-relay authors
License: Apache-2.0
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
COPY

# The newest glibc symbol version the binary needs: its real dependency.
glibc=$(objdump -T "$bin" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1)
size_kb=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
install -d -m 0755 "$root/DEBIAN"
cat > "$root/DEBIAN/control" <<CONTROL
Package: outbox-relay
Version: $version
Architecture: $arch
Maintainer: outbox-relay authors <outbox-relay@localhost>
Installed-Size: $size_kb
Depends: libc6 (>= $glibc), passwd
Section: net
Priority: optional
Homepage: https://github.com/outbox-relay/outbox-relay
Description: transactional outbox relay: PostgreSQL logical replication to RabbitMQ
 Tails a pgoutput replication slot filtered to an outbox table and publishes
 each committed row to RabbitMQ with publisher confirms, advancing the slot
 only after the broker has acknowledged. At-least-once, with a stable
 message_id for de-duplication.
CONTROL
echo /etc/outbox-relay/outbox-relay.toml > "$root/DEBIAN/conffiles"
install -m 0755 deploy/deb/postinst deploy/deb/prerm deploy/deb/postrm "$root/DEBIAN/"

mkdir -p "$out"
deb="$out/outbox-relay_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Z"${DEB_COMPRESS:-xz}" --build "$root" "$deb" >/dev/null
echo "$deb"
