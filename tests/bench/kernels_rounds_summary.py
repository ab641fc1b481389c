import json,sys,statistics as st
from collections import defaultdict
rows=[json.loads(l) for l in open(sys.argv[1])]
R=defaultdict(list); M=defaultdict(list); loads=[]
byround=defaultdict(dict)
for d in rows:
    if d['op']=='read_bw': continue
    k=(d['binary'],d['isa'],d['threads'],d['layer'],d['tokens'])
    R[k].append(d['ratio']); M[k].append(d['ms'])
    byround[(d['binary'],d['isa'],d['threads'],d['layer'],d['round'])][d['tokens']]=d['ms']
    loads.append(d['load_before'])
def f(v): return "%.3f [%.3f, %.3f]"%(st.median(v),min(v),max(v))
print("load before each run: median %.1f [%.1f, %.1f]"%(st.median(loads),min(loads),max(loads)))
print("| binary | isa | thr | layer | T | ratio to read pass | ms per call | call / T=1 call |")
print("|---|---|---|---|---|---|---|---|")
for k in sorted(R):
    b,isa,th,layer,T=k
    tr=[v[T]/v[1] for (bb,ii,tt,ll,r),v in byround.items() if (bb,ii,tt,ll)==(b,isa,th,layer) and 1 in v and T in v]
    print("| %s | %s | %d | %s | %d | %s | %s | %s |"%(b,isa,th,layer,T,f(R[k]),f(M[k]),f(tr)))
