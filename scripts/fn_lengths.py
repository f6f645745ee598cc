#!/usr/bin/env python3
"""Lists product Rust functions longer than N lines (signature to closing brace), skipping #[cfg(test)] modules, tests.rs and conformance.rs: the house rule is none over 100.

Usage: python3 scripts/fn_lengths.py [N] [DIR ...]   (default 100, every product crate)"""
import re,sys,os
N=int(sys.argv[1]) if len(sys.argv)>1 else 100
roots=sys.argv[2:] or ['src','crates/gturbo-format/src','crates/gturbo-source/src','crates/gturbo-install/src','crates/gturbo-runtime/src']
fnre=re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)')
out=[]
for root in roots:
  for d,_,fs in os.walk(root):
    for f in fs:
      if not f.endswith('.rs') or f in ('tests.rs','conformance.rs'): continue
      p=os.path.join(d,f); L=open(p).read().split('\n')
      # cut at #[cfg(test)] mod tests
      end=len(L)
      for i,l in enumerate(L):
        if l.startswith('#[cfg(test)]') and i+1<len(L) and re.match(r'\s*(pub\s+)?mod\s+\w+',L[i+1]): end=i;break
      i=0
      while i<end:
        m=fnre.match(L[i])
        if m:
          depth=0; started=False; j=i
          while j<end:
            s=re.sub(r'"(\\.|[^"\\])*"','""',L[j]); s=re.sub(r"'(\\.|[^'\\])'","''",s); s=s.split('//')[0]
            for ch in s:
              if ch=='{': depth+=1; started=True
              elif ch=='}': depth-=1
            if started and depth==0: break
            if not started and s.rstrip().endswith(';'): break
            j+=1
          n=j-i+1
          if started and n>N: out.append((n,p,i+1,m.group(6)))
          i=j+1 if started else i+1
        else: i+=1
for n,p,l,name in sorted(out,reverse=True): print(f'{n:5d} {p}:{l} {name}')
print(f'{len(out)} functions over {N} lines')
