// Command bench-topology measures NVLink placement on the real kube-scheduler
// (the in-process control plane): a fleet of simulated hosts of several
// shapes (our node plugin on the simulator, one process per node; the nodes
// run no containers: a pod is Running once its claims are prepared), then
// rounds of 4-GPU and 2-GPU claims, each round once with
// `matchAttribute: gpu.nvidia.com/nvlinkDomain` on every claim and once
// without (what a claim gets that does not ask), alternating, the devices
// freed between rounds. For every placed claim it asks the node's own
// `nvidia-smi topo -m` whether the GPUs it got are pairwise NVLink peers, so
// the figures do not depend on the attribute they measure.
//
// It prints, per round and over all rounds, the placed claims of each size
// and the share on NVLink, the claims left Pending (with the constraint,
// those for which the fleet has no NVLink set left), and the scheduler's
// pods/s: pods bound over the time from the round's first creation to its
// last binding (medians over the rounds). The table is also written to --out.
//
// The fleet is --fleet (env BENCH_FLEET): profile=count,... of the
// simulator's profiles. BENCH_PROFILE (debug or release) names the cargo
// profile whose binaries E2E_BIN_DIR holds, printed with the figures.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gpu-dra/e2e/harness"
)

func main() {
	fleet := flag.String("fleet", envString("BENCH_FLEET", "a100-pcie-x4-nvlink=12,h100-pcie-x8-nvlink=12,l40s-x8=8,dgx1-v100=4"),
		"simulated hosts, profile=count,... (env BENCH_FLEET)")
	quads := flag.Int("quads", harness.EnvIntOrExit("bench-topology", "BENCH_QUADS", 16), "4-GPU claims per round, created first (env BENCH_QUADS)")
	pairs := flag.Int("pairs", harness.EnvIntOrExit("bench-topology", "BENCH_PAIRS", 64), "2-GPU claims per round, created after the 4-GPU ones (env BENCH_PAIRS)")
	rounds := flag.Int("rounds", harness.EnvIntOrExit("bench-topology", "BENCH_ROUNDS", 5), "rounds with the constraint, and as many without (env BENCH_ROUNDS)")
	parallel := flag.Int("parallel", 16, "concurrent pod creations")
	out := flag.String("out", os.Getenv("BENCH_OUT"), "file the figures are written to as well (env BENCH_OUT; empty: none)")
	flag.Parse()
	hosts, err := parseFleet(*fleet)
	if err == nil && (*quads < 0 || *pairs < 0 || *quads+*pairs == 0 || *rounds < 1) {
		err = fmt.Errorf("--quads %d, --pairs %d, --rounds %d: want some claims and at least one round", *quads, *pairs, *rounds)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-topology:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, hosts, *quads, *pairs, *rounds, *parallel, *out); err != nil {
		fmt.Fprintln(os.Stderr, "bench-topology:", err)
		os.Exit(1)
	}
}

func envString(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// envInt is harness.EnvInt; a value that is not an integer stops the
// benchmark naming it.
// host is one entry of the fleet: count nodes of a simulator profile.
type host struct {
	profile string
	count   int
}

// parseFleet reads profile=count,...
func parseFleet(s string) ([]host, error) {
	var out []host
	for _, part := range strings.Split(s, ",") {
		profile, count, ok := strings.Cut(strings.TrimSpace(part), "=")
		n, err := strconv.Atoi(count)
		if !ok || profile == "" || err != nil || n < 1 {
			return nil, fmt.Errorf("--fleet %q: entry %q: want profile=count with a count of at least 1", s, part)
		}
		if slices.ContainsFunc(out, func(h host) bool { return h.profile == profile }) {
			return nil, fmt.Errorf("--fleet %q: profile %s named twice", s, profile)
		}
		out = append(out, host{profile, n})
	}
	return out, nil
}

// fleetLabel marks the benchmark's nodes; every pod selects it.
const fleetLabel = "e2e.gpu-dra/fleet"

func run(ctx context.Context, hosts []host, quads, pairs, rounds, parallel int, outPath string) error {
	buildProfile := envString("BENCH_PROFILE", "debug")
	bin, err := harness.Binary("gpu-kubelet-plugin")
	if err != nil {
		return err
	}
	if _, err := harness.Binary("gpu-sim"); err != nil {
		return err
	}
	logf := func(f string, a ...any) { fmt.Printf(f+"\n", a...) }
	fmt.Printf("plugin: %s build, %s\n", buildProfile, bin)
	c, err := harness.Start(ctx, harness.Options{Logf: logf})
	if err != nil {
		return err
	}
	defer c.Stop()
	_, webhookErr := harness.Binary("gpu-dra-webhook")
	if _, err := c.InstallDriver(ctx, harness.InstallOptions{Webhook: webhookErr == nil}); err != nil {
		return err
	}

	var profiles []string            // of node i
	profileOf := map[string]string{} // node name -> profile
	var fleetDesc []string
	// Node i's profile goes round the hosts (a, b, c, a, b, c, a, ...): the
	// scheduler breaks ties between equal nodes in an order of its own, and
	// one host shape listed first must not get the claims for that alone.
	left := map[string]int{}
	for _, h := range hosts {
		left[h.profile] += h.count
		fleetDesc = append(fleetDesc, fmt.Sprintf("%d x %s", h.count, h.profile))
	}
	for len(profiles) < sumCounts(hosts) {
		for _, h := range hosts {
			if left[h.profile] > 0 {
				left[h.profile]--
				profiles = append(profiles, h.profile)
			}
		}
	}
	for i, p := range profiles {
		profileOf[nodeName(profiles, i)] = p
	}
	start := time.Now()
	nodes, err := c.AddFleet(ctx, harness.FleetOptions{
		Count: len(profiles),
		Node: func(i int) harness.NodeOptions {
			return harness.NodeOptions{Name: nodeName(profiles, i), NoContainers: true, Labels: map[string]string{fleetLabel: "topology"}}
		},
		Start: func(ctx context.Context, i int, n *harness.Node) error {
			_, err := n.StartPlugin(ctx, harness.PluginOptions{Profile: profiles[i]})
			return err
		},
		Logf: logf,
	})
	if err != nil {
		return err
	}
	devices, err := c.WaitFleetPublished(ctx, nodes, harness.DefaultDriver, 5*time.Minute, logf)
	if err != nil {
		return err
	}
	fmt.Printf("%d nodes registered and published (%d devices) %s after start\n", len(nodes), devices, time.Since(start).Round(time.Millisecond))

	ns := "topology"
	if err := c.CreateNamespace(ctx, ns); err != nil {
		return err
	}
	var gpus []int64
	for range quads {
		gpus = append(gpus, 4)
	}
	for range pairs {
		gpus = append(gpus, 2)
	}
	// Rounds alternate, and which kind goes first alternates too, so neither
	// always meets the control plane warmer.
	results := map[bool][]*harness.PlacementResult{}
	var roundLines []string
	for i := range 2 * rounds {
		nvlink := (i%2 == 0) != (i/2%2 == 1)
		name := fmt.Sprintf("r%d-%s", i/2+1, kind(nvlink))
		res, err := c.RunPlacement(ctx, harness.PlacementRound{
			Namespace: ns, Name: name, GPUs: gpus, NVLink: nvlink,
			NodeSelector: map[string]string{fleetLabel: "topology"}, Parallel: parallel,
		})
		if err != nil {
			return err
		}
		s := summarize([]*harness.PlacementResult{res})
		roundLines = append(roundLines, fmt.Sprintf("round %-22s %s", name, s.line()))
		fmt.Println(roundLines[len(roundLines)-1])
		results[nvlink] = append(results[nvlink], res)
		if err := c.DeletePlacement(ctx, ns, 5*time.Minute); err != nil {
			return err
		}
	}

	var w io.Writer = os.Stdout
	var file *os.File
	if outPath != "" {
		if err := os.MkdirAll(filepath.Dir(outPath), 0o755); err != nil {
			return err
		}
		if file, err = os.Create(outPath); err != nil {
			return err
		}
		defer file.Close()
		w = io.MultiWriter(os.Stdout, file)
	}
	fmt.Fprintf(w, "\n== NVLink placement on kube-scheduler %s, %s plugins, %s\n", harness.KubernetesVersion, buildProfile, time.Now().UTC().Format("2006-01-02"))
	fmt.Fprintf(w, "fleet: %s (%d nodes, %d GPUs); nodes run no containers\n", strings.Join(fleetDesc, ", "), len(nodes), devices)
	fmt.Fprintf(w, "per round: %d claims of 4 GPUs, then %d of 2 GPUs (%d GPUs), %d created at once; %d rounds each, alternating, devices freed between rounds\n",
		quads, pairs, 4*quads+2*pairs, parallel, rounds)
	fmt.Fprintf(w, "on NVLink: every two GPUs of the claim NV# in the node's nvidia-smi topo -m; pods/s: pods bound / (first creation -> last binding), median of rounds\n\n")
	fmt.Fprintf(w, "%-28s %-22s %-22s %-8s %-14s %-8s %s\n", "claims", "2-GPU placed, NVLink", "4-GPU placed, NVLink", "pending", "all scheduled", "pods/s", "create->bound p50")
	for _, nvlink := range []bool{true, false} {
		label := "with matchAttribute"
		if !nvlink {
			label = "without (today's claims)"
		}
		s := summarize(results[nvlink])
		fmt.Fprintf(w, "%-28s %s\n", label, s.line())
	}
	fmt.Fprintf(w, "\n%s\n", strings.Join(roundLines, "\n"))
	// Where the claims went explains the shares: a host shape's NVLink sets
	// are taken only as far as claims land there.
	fmt.Fprintf(w, "\nplaced on, by host (all rounds):\n")
	for _, nvlink := range []bool{true, false} {
		for _, size := range []int{4, 2} {
			byHost := map[string]int{}
			for _, r := range results[nvlink] {
				for _, p := range r.Placed {
					if p.GPUs == size {
						byHost[profileOf[p.Node]]++
					}
				}
			}
			var parts []string
			for _, h := range hosts {
				parts = append(parts, fmt.Sprintf("%s %d", h.profile, byHost[h.profile]))
			}
			fmt.Fprintf(w, "  %-8s %d-GPU: %s\n", kind(nvlink), size, strings.Join(parts, ", "))
		}
	}
	if file != nil {
		if err := file.Close(); err != nil {
			return err
		}
		fmt.Printf("\nwritten to %s\n", outPath)
	}
	return nil
}

func sumCounts(hosts []host) int {
	n := 0
	for _, h := range hosts {
		n += h.count
	}
	return n
}

// nodeName is the name of node i of the fleet.
func nodeName(profiles []string, i int) string {
	return fmt.Sprintf("%s-%02d", profiles[i], i)
}

func kind(nvlink bool) string {
	if nvlink {
		return "nvlink"
	}
	return "plain"
}

// summary is a set of rounds in figures.
type summary struct {
	asked, placed, onNVLink map[int]int // by claim size
	pending                 int
	allScheduled            time.Duration // median of rounds
	podsPerSec              float64       // median of rounds
	bindP50                 time.Duration // over every placed pod
}

func summarize(rs []*harness.PlacementResult) summary {
	s := summary{asked: map[int]int{}, placed: map[int]int{}, onNVLink: map[int]int{}}
	var all []time.Duration
	var rates []float64
	var binds []time.Duration
	for _, r := range rs {
		for _, p := range r.Placed {
			s.asked[p.GPUs]++
			s.placed[p.GPUs]++
			if p.NVLink {
				s.onNVLink[p.GPUs]++
			}
			binds = append(binds, p.Scheduled)
		}
		for _, size := range r.Pending {
			s.asked[size]++
			s.pending++
		}
		all = append(all, r.AllScheduled)
		if r.AllScheduled > 0 {
			rates = append(rates, float64(len(r.Placed))/r.AllScheduled.Seconds())
		}
	}
	s.allScheduled = median(all)
	sort.Float64s(rates)
	if len(rates) > 0 {
		s.podsPerSec = rates[len(rates)/2]
	}
	s.bindP50 = median(binds)
	return s
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	return ds[len(ds)/2]
}

func (s summary) line() string {
	share := func(size int) string {
		if s.asked[size] == 0 {
			return "-"
		}
		pct := "-"
		if s.placed[size] > 0 {
			pct = fmt.Sprintf("%.0f%%", 100*float64(s.onNVLink[size])/float64(s.placed[size]))
		}
		return fmt.Sprintf("%d/%d, %d (%s)", s.placed[size], s.asked[size], s.onNVLink[size], pct)
	}
	return fmt.Sprintf("%-22s %-22s %-8d %-14s %-8.1f %s", share(2), share(4), s.pending,
		s.allScheduled.Round(time.Millisecond), s.podsPerSec, s.bindP50.Round(time.Millisecond))
}
