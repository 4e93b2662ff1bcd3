package harness

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
)

// ErrMissing marks a part of the product that is not built or not present
// (binary, chart, tool). Tests skip on it with the message, never silently.
var ErrMissing = errors.New("missing")

// RepoRoot is the repository root: env E2E_REPO_ROOT, else the first
// directory above the working directory holding both Cargo.toml and e2e/.
func RepoRoot() (string, error) {
	if r := os.Getenv("E2E_REPO_ROOT"); r != "" {
		return filepath.Abs(r)
	}
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if isFile(filepath.Join(dir, "Cargo.toml")) && isDir(filepath.Join(dir, "e2e")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("repository root not found above the working directory (set E2E_REPO_ROOT)")
		}
		dir = parent
	}
}

// Binary finds one of our built binaries: in env E2E_BIN_DIR if set, else
// in <repo>/target/debug (what `cargo build` produces). A binary that does
// not offer what the suite runs yet (its --help lacks the subcommand or
// flag) counts as missing.
func Binary(name string) (string, error) {
	return BinaryWith(name, helpMentions[name])
}

// BinaryWith is Binary with the --help requirement given (nil: none).
func BinaryWith(name string, want *regexp.Regexp) (string, error) {
	dir := os.Getenv("E2E_BIN_DIR")
	if dir == "" {
		root, err := RepoRoot()
		if err != nil {
			return "", err
		}
		dir = filepath.Join(root, "target", "debug")
	}
	p := filepath.Join(dir, name)
	if !isFile(p) {
		return "", fmt.Errorf("%w: binary %s not found in %s (run `cargo build` first, or set E2E_BIN_DIR)", ErrMissing, name, dir)
	}
	if want != nil {
		out, _ := exec.Command(p, "--help").CombinedOutput()
		if !want.Match(out) {
			return "", fmt.Errorf("%w: %s does not offer what e2e needs yet (its --help does not match %q)", ErrMissing, p, want)
		}
	}
	return p, nil
}

// helpMentions tells a real binary from the workspace skeleton's empty
// placeholder: what its --help must mention.
var helpMentions = map[string]*regexp.Regexp{
	"gpu-kubelet-plugin": regexp.MustCompile(`(?m)^\s+run\b`),
	"gpu-dra-webhook":    regexp.MustCompile(`--tls-cert-file`),
	"gpu-sim":            regexp.MustCompile(`(?m)^\s+setup\b`),
}

// Tool finds a helper tool (helm, kubectl): <repo>/.tools/bin first, then PATH.
func Tool(name string) (string, error) {
	if root, err := RepoRoot(); err == nil {
		p := filepath.Join(root, ".tools", "bin", name)
		if isFile(p) {
			return p, nil
		}
	}
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	return "", fmt.Errorf("%w: tool %s not in .tools/bin nor PATH (run `make e2e-tools`)", ErrMissing, name)
}

// RepoPath is a path inside the repository, with ErrMissing if absent.
func RepoPath(rel string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	p := filepath.Join(root, rel)
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%w: %s not in the repository yet", ErrMissing, rel)
	}
	return p, nil
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}
