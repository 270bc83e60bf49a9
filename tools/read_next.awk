# make diff: after each diff, where to read next in the header.
#
#   diff OLD/train.c NEW/train.c | awk -f tools/read_next.awk src/*.h OLD/train.c NEW/train.c -
#
# lists the functions, macros and types of the header's chapters (src/, which
# tools/assemble puts together as dtrain.h; dtrain.h alone serves as well) that
# the lines NEW adds use, each with the chapter lines that declare and define
# it: what the
# diff switches on is then one jump away. First what OLD did not use at all
# (the new mechanism), then what it did (lines the diff only rewords).
#
# Everything is found in the files as they are now, so the line numbers follow
# the header as it changes. A name only counts in code: comments and string
# literals are blanked first, and so are field names (run.scaler, s->comm).
# The header is read by its layout, which every top-level line follows: a
# declaration or definition starts in column 0 with its type; bodies, members
# and continuation lines are indented. A function is "defined" where its
# parameter list is followed by a body, "declared" where by a semicolon.

# Blank out comments and string and character literals, one line at a time
# (`inblock`: inside a /* comment that an earlier line opened).
function strip(s,    out, i, n, c, q) {
    if (!inblock && s !~ /["'\/]/) return s
    out = ""
    n = length(s)
    for (i = 1; i <= n; i++) {
        c = substr(s, i, 1)
        if (inblock) {
            if (c == "*" && substr(s, i + 1, 1) == "/") { inblock = 0; i++; out = out " " }
            continue
        }
        if (c == "/" && substr(s, i + 1, 1) == "*") { inblock = 1; i++; continue }
        if (c == "/" && substr(s, i + 1, 1) == "/") break
        if (c == "\"" || c == "'") {
            q = c
            for (i++; i <= n && substr(s, i, 1) != q; i++)
                if (substr(s, i, 1) == "\\") i++
            out = out " "
            continue
        }
        out = out c
    }
    return out
}

function note(name, line, kind) {
    if (index(refs[name], FILENAME ":" line " ") == 0)
        refs[name] = refs[name] "  " FILENAME ":" line " (" kind ")"
}

# After a function's name: follow its parameter list (and any attributes or
# preprocessor lines after it) to the brace or semicolon that says which it is.
function follow(s,    i, n, c) {
    if (s ~ /^[ \t]*#/) return
    n = length(s)
    for (i = 1; i <= n && pending != ""; i++) {
        c = substr(s, i, 1)
        if (c == "(") depth++
        else if (c == ")") depth--
        else if (depth == 0 && c == "{") { note(pending, pending_line, "defined"); pending = "" }
        else if (depth == 0 && (c == ";" || c == "," || c == "=")) { note(pending, pending_line, "declared"); pending = "" }
    }
}

# Inside a struct, union or enum body: where its braces close, the typedef's
# name (if any) follows; it is defined where the body opened.
function close_type(s,    i, n, c, name) {
    n = length(s)
    for (i = 1; i <= n; i++) {
        c = substr(s, i, 1)
        if (c == "{") type_depth++
        else if (c == "}" && --type_depth == 0) {
            name = substr(s, i + 1)
            if (match(name, /^[ \t]*[A-Za-z_][A-Za-z0-9_]*[ \t]*;/)) {
                name = substr(name, 1, RLENGTH - 1)
                gsub(/[ \t]/, "", name)
                note(name, type_line, "defined")
            }
            type_line = 0
            return
        }
    }
}

function index_header(s,    name, rest, prefix) {
    if (pending != "") { follow(s); return }
    if (s ~ /^[ \t]*#[ \t]*define[ \t]+[A-Za-z_]/) {
        name = s
        sub(/^[ \t]*#[ \t]*define[ \t]+/, "", name)
        match(name, /^[A-Za-z_][A-Za-z0-9_]*/)
        note(substr(name, 1, RLENGTH), FNR, "macro")
        return
    }
    if (s ~ /^typedef[ \t]+(struct|union|enum)[ \t]+[A-Za-z_][A-Za-z0-9_]*[ \t]+[A-Za-z_][A-Za-z0-9_]*[ \t]*;/) {
        name = s
        sub(/[ \t]*;.*$/, "", name)
        sub(/^.*[ \t]/, "", name)
        note(name, FNR, "declared")
        return
    }
    if (s ~ /^(typedef[ \t]+)?(struct|union|enum)[ \t]*([A-Za-z_][A-Za-z0-9_]*)?[ \t]*\{/) {
        type_line = FNR
        type_depth = 0
        name = s
        sub(/^(typedef[ \t]+)?(struct|union|enum)[ \t]*/, "", name)
        if (match(name, /^[A-Za-z_][A-Za-z0-9_]*/)) note(substr(name, 1, RLENGTH), FNR, "defined")
    }
    if (type_line) { close_type(s); return }
    if (s ~ /^typedef/ && s !~ /\{/) {
        if (match(s, /\(\*[A-Za-z_][A-Za-z0-9_]*\)/)) name = substr(s, RSTART + 2, RLENGTH - 3)
        else {
            rest = s
            sub(/[ \t]*(__attribute__.*)?;.*$/, "", rest)
            match(rest, /[A-Za-z_][A-Za-z0-9_]*$/)
            name = substr(rest, RSTART, RLENGTH)
        }
        if (name != "") note(name, FNR, "defined")
        return
    }
    if (s ~ /^[A-Za-z_]/ && match(s, /[A-Za-z_][A-Za-z0-9_]*\(/)) {
        prefix = substr(s, 1, RSTART - 1)
        name = substr(s, RSTART, RLENGTH - 1)
        if (prefix !~ /^[A-Za-z_][A-Za-z0-9_ \t*]*[ \t*]$/ || prefix ~ /^(typedef|return|else|case|goto)[ \t]/ ||
            name ~ /^(if|for|while|switch|return|sizeof|void|int|char|float|double)$/)
            return
        pending = name
        pending_line = FNR
        depth = 0
        follow(substr(s, RSTART + RLENGTH - 1))
    }
}

# The names a line of code uses, in order, less field names and the tails of
# numbers (the e5 of 1e5).
function uses(s, into, ordered,    before, name) {
    while (match(s, /[A-Za-z_][A-Za-z0-9_]*/)) {
        before = substr(s, 1, RSTART - 1)
        name = substr(s, RSTART, RLENGTH)
        s = substr(s, RSTART + RLENGTH)
        if (before ~ /(\.|->)[ \t]*$/ || before ~ /[0-9]$/) continue
        if (!(name in into)) { into[name] = 1; if (ordered) order[++norder] = name }
    }
}

# The header files come first, then OLD, NEW and the diff: the last three arguments.
BEGIN { headers = ARGC - 4; header = headers == 1 ? ARGV[1] : "src/" }
FNR == 1 { file++; inblock = 0; pending = ""; type_line = 0 }
file <= headers { index_header(strip($0)); next }
file == headers + 1 { uses(strip($0), old_uses, 0); next }
file == headers + 2 { code[FNR] = strip($0); next }
# diff's normal output: "12a13,15" or "7,9c7,8" -- the NEW lines after the letter.
file == headers + 3 && /^[0-9,]+[ac][0-9,]+$/ {
    range = $0
    sub(/^[0-9,]+[ac]/, "", range)
    if (split(range, ends, ",") == 1) ends[2] = ends[1]
    for (i = ends[1]; i <= ends[2]; i++) uses(code[i], new_uses, 1)
}

function show(title, already,    i, name, shown) {
    for (i = 1; i <= norder; i++) {
        name = order[i]
        if (!(name in refs) || (name in old_uses) != already) continue
        if (!shown++) print "  " title
        printf "    %-" width "s%s\n", name, refs[name]
    }
    return shown
}

END {
    old = ARGV[headers + 1]; sub(/\/train\.c$/, "", old)
    new = ARGV[headers + 2]; sub(/\/train\.c$/, "", new)
    width = 24
    for (i = 1; i <= norder; i++)
        if (order[i] in refs && length(order[i]) + 2 > width) width = length(order[i]) + 2
    print "---- " old " -> " new ": read next in " header " (what the added lines use)"
    if (show("new in " new ":", 0) + show("already used in " old ":", 1) == 0) print "  (nothing from " header ")"
}
