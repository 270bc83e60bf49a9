#!/usr/bin/env python3
"""tools/check_links.py: the project's pages link to what exists.

    tools/check_links.py [--front README.md] FILE.md...

Every markdown link or image in the FILEs that is not a URL must name a file
that exists (relative to the page), and an #anchor into a .md file must be one
of its headings (GitHub's slugs). With --front PAGE, every FILE must also be
one link away from PAGE (linked from it directly), as the README promises.
Prints each fault and exits 1 when there is one."""
import os, re, sys

def slug(heading):
    heading = re.sub(r'[^\w\- ]', '', heading.strip().lower())
    return heading.replace(' ', '-')

def anchors(path):
    found, seen, in_code = set(), {}, False
    for line in open(path, encoding='utf-8'):
        if line.startswith('```'):
            in_code = not in_code
            continue
        m = None if in_code else re.match(r'(#{1,6})\s+(.*?)\s*#*\s*$', line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f'{s}-{n}')
    return found

def links(path):
    text = re.sub(r'```.*?```', '', open(path, encoding='utf-8').read(), flags=re.S)
    return [m.group(1) for m in re.finditer(r'\]\(([^)\s]+)\)', text)]

args = sys.argv[1:]
front = None
if args[:1] == ['--front']:
    if len(args) < 2: sys.exit('tools/check_links.py: --front needs a page')
    front, args = args[1], args[2:]
if not args: sys.exit('usage: tools/check_links.py [--front README.md] FILE.md...')
faults = count = 0
linked = set()
for page in args:
    for target in links(page):
        count += 1
        if re.match(r'[a-z]+:', target):
            continue
        path, _, anchor = target.partition('#')
        where = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if page == front:
            linked.add(where)
        if not os.path.exists(where):
            print(f'{page}: links to {target}, which does not exist')
            faults += 1
        elif anchor and where.endswith('.md') and anchor not in anchors(where):
            print(f'{page}: links to {target}, but {where} has no heading #{anchor}')
            faults += 1
if front:
    for page in args:
        if os.path.normpath(page) != os.path.normpath(front) and os.path.normpath(page) not in linked:
            print(f'{page}: not linked from {front} (every page is one link away from it)')
            faults += 1
print(f'{count} links in {len(args)} pages checked, {faults} fault{"" if faults == 1 else "s"}')
sys.exit(1 if faults else 0)
