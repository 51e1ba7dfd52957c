set terminal pngcairo size 1000,480 noenhanced
set output 'docs/bench/digits.png'
set title 'digits MLP: steps/s (median of 7), higher is better'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set key outside right top vertical
set ylabel 'steps/s'
set yrange [0:*]
set grid ytics
colors = "#1f4e9c #b34d00 #4f81d4 #e6862e #9bbcf0 #f5c08a"
plot for [i=2:7] 'docs/bench/digits.dat' using i:xtic(1) title columnheader(i) lc rgb word(colors, i-1)
