package harness

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"time"
)

// CA is a throw-away certificate authority for one cluster: it signs the
// apiserver's serving certificate and the webhook's, so every client in the
// harness trusts exactly one bundle (CertPEM).
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// CertPEM is the CA certificate, PEM encoded (the caBundle of webhook configs
	// and the certificate-authority-data of kubeconfigs).
	CertPEM []byte
}

// NewCA creates a self-signed CA valid for a day.
func NewCA() (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "gpu-dra-e2e-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("self-sign CA: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{cert: cert, key: key, CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// IssueServing writes a serving certificate for 127.0.0.1 and localhost (plus
// the given DNS names) to dir/<name>.crt and dir/<name>.key and returns both paths.
func (ca *CA) IssueServing(dir, name string, dnsNames ...string) (certFile, keyFile string, err error) {
	return ca.issue(dir, name, certRequest{
		commonName: name,
		server:     true,
		dnsNames:   append([]string{"localhost"}, dnsNames...),
		ips:        []net.IP{net.ParseIP("127.0.0.1")},
	})
}

// writeSigningKey writes a fresh EC private key used to sign and verify
// service-account tokens.
func writeSigningKey(path string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600)
}
