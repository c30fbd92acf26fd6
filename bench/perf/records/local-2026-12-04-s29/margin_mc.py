import random, math, statistics as st
def clear_rate(n, trials=200000, gain=0.0):
    r = random.Random(1); hit = 0
    for _ in range(trials):
        xs = [r.gauss(0,1) for _ in range(n)]
        s = st.stdev(xs); m = st.mean(xs)
        cand = r.gauss(-gain, 1)
        if m - cand > 3.5*s*math.sqrt(2): hit += 1
    return hit/trials
for n in (3,4,5,6,8,10):
    print(n, "no-op clears", round(clear_rate(n),5), "6-sigma gain clears", round(clear_rate(n, 50000, 6.0),3), "5-sigma", round(clear_rate(n, 50000, 5.0),3))
