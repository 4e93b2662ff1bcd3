package harness

// `gpu-dra check` run as an admin runs it, against a cluster's API server with
// its admin kubeconfig, and its JSON report read back (crates/cli/src/check).

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// CheckReport is the part of `gpu-dra check -o json` tests read.
type CheckReport struct {
	Status string        `json:"status"`
	Checks []CheckResult `json:"checks"`
}

// CheckResult is one check of a CheckReport.
type CheckResult struct {
	Name   string   `json:"name"`
	Status string   `json:"status"`
	Detail []string `json:"detail"`
	Fix    string   `json:"fix"`
}

// Find is the check named name; the test fails when the report has none.
func (r CheckReport) Find(t testing.TB, name string) CheckResult {
	t.Helper()
	for _, c := range r.Checks {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no check %s in the report: %+v", name, r)
	return CheckResult{}
}

// Check runs `gpu-dra check --namespace DriverNamespace -o json` (with the
// extra flags) against the cluster as its admin and returns its report and
// exit status; the test fails when the CLI is not built or its output is not
// a report.
func (c *Cluster) Check(t testing.TB, flags ...string) (CheckReport, int) {
	t.Helper()
	return c.CheckWith(t, c.Kubeconfig, flags...)
}

// CheckWith is Check with the credentials of kubeconfig.
func (c *Cluster) CheckWith(t testing.TB, kubeconfig string, flags ...string) (CheckReport, int) {
	t.Helper()
	bin, err := Binary("gpu-dra")
	if err != nil {
		t.Fatalf("no gpu-dra CLI: %v", err)
	}
	cmd := exec.Command(bin, append([]string{"check", "--namespace", DriverNamespace, "-o", "json"}, flags...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	code := 0
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		code = exit.ExitCode()
	} else if err != nil {
		t.Fatalf("gpu-dra check: %v", err)
	}
	var report CheckReport
	if err := json.Unmarshal(out, &report); err != nil {
		t.Fatalf("gpu-dra check (exit %d): %v; stdout:\n%s\nstderr:\n%s", code, err, out, stderr.String())
	}
	t.Logf("gpu-dra check %s: exit %d, status %s\n%s", strings.Join(flags, " "), code, report.Status, out)
	return report, code
}

// CheckOnly runs `gpu-dra check --only name` (with the extra flags) and
// returns that check's result and the exit status, which counts only it.
func (c *Cluster) CheckOnly(t testing.TB, name string, flags ...string) (CheckResult, int) {
	t.Helper()
	report, code := c.Check(t, append([]string{"--only", name}, flags...)...)
	if len(report.Checks) != 1 {
		t.Fatalf("gpu-dra check --only %s reported %d checks, want 1: %+v", name, len(report.Checks), report)
	}
	return report.Find(t, name), code
}

// ExpectCheckFailed asserts that r failed, with each of detail in its detail
// lines and each of fix in its fix, and that the run that reported it alone
// exited 1.
func ExpectCheckFailed(t testing.TB, r CheckResult, code int, detail, fix []string) {
	t.Helper()
	if r.Status != "failed" || code != 1 {
		t.Errorf("check %s: %q, exit %d; want failed, exit 1: %v; fix: %s", r.Name, r.Status, code, r.Detail, r.Fix)
	}
	lines := strings.Join(r.Detail, "\n")
	for _, d := range detail {
		if !strings.Contains(lines, d) {
			t.Errorf("check %s detail %q does not say %q", r.Name, r.Detail, d)
		}
	}
	for _, f := range fix {
		if !strings.Contains(r.Fix, f) {
			t.Errorf("check %s fix %q does not say %q", r.Name, r.Fix, f)
		}
	}
}

// ExpectCheckPassed asserts that r passed and the run that reported it alone
// exited 0.
func ExpectCheckPassed(t testing.TB, r CheckResult, code int) {
	t.Helper()
	if r.Status != "passed" || code != 0 {
		t.Errorf("check %s: %q, exit %d; want passed, exit 0: %v; fix: %s", r.Name, r.Status, code, r.Detail, r.Fix)
	}
}
