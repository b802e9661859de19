# Sourced by the cached Go build scripts (tests/kyverno/build.sh, tests/tools/build.sh).
#
# copy_main_module_directives GOMOD: copies the non-local `replace` lines and the `godebug`
# lines of GOMOD into the go.mod of the current directory. Both act only in the main module, so
# a throw-away wrapper module that builds someone else's commands must repeat them (Kyverno and
# Argo CD pin k8s.io/* that way). Local targets (./, ../) are skipped. Prints the directives to
# stderr.
copy_main_module_directives() {
    local gomod=$1 line lhs rhs gd
    local args=()
    # Single-line `replace a [v] => b [v]` and the lines of `replace ( ... )` blocks; comments
    # stripped.
    while read -r line; do
        [[ -z $line ]] && continue
        lhs=$(echo ${line%%=>*} | tr ' ' @)
        rhs=$(echo ${line#*=>} | tr ' ' @)
        [[ $rhs == .* ]] && continue
        args+=("-replace=$lhs=$rhs")
    done < <(sed -e 's#//.*##' -n -e '/^replace[[:space:]]*(/,/^)/{/=>/p;}' -e 's/^replace[[:space:]]\{1,\}\([^(].*=>.*\)$/\1/p' "$gomod")
    while read -r gd; do [[ -n $gd ]] && args+=("-godebug=$gd"); done < <(sed -n 's/^godebug[[:space:]]\{1,\}\([^()[:space:]]*\)$/\1/p' "$gomod")
    ((${#args[@]} > 0)) || return 0
    printf 'main-module directives copied from %s: %s\n' "$gomod" "${args[*]}" >&2
    go mod edit "${args[@]}"
}
